#!/usr/bin/env bash
# The one GPU check of a lent CUDA machine (issue 14, item 7; docs/planner.md "GPU check").
#
# Run from anywhere, on a machine with torch (CUDA build) and no package registry:
#     bash benchmarks/device_check.sh            # output under $OUT (else ./device-check-out)
#
# Stages, each under `timeout`, all output tee'd to $OUT, none stopping the others:
#   1. env      : python, torch, CUDA, NCCL, the GPU (nvidia-smi), which optional packages exist
#   2. tests    : the GPU-marked tests (tests/test_gpu_runtime.py) with pytest if it imports, else the
#                 module's own runner (the same functions)
#   3. sweep    : benchmarks/gpu_check.py: 125M / 1B / 3B GPTs, bf16, with / without checkpointing, two
#                 sequence lengths; measured vs predicted step time, peak memory, MFU (table + JSON)
#   4. breakdown: benchmarks/gpu_breakdown.py: device time per kernel class (matmul, attention, loss, casts,
#                 norms, optimizer, other) against the planner's FLOPs, bytes and rates for each
#   5. cli      : `modelpar train` of gpt-100m and of a Hugging Face Llama from its config, one rank, the
#                 planner's pick (only where jsonargparse and docstring_parser import)
# Then a summary of every stage's exit status (also in $OUT/summary.txt). Exit status: 0 when every
# stage passed, else 1. Without CUDA it says so after stage 1 and exits 0.
#
# Time (worst case, every stage running to its timeout): 45 + 180 + 255 + 120 + 150 s = 12.5 minutes. Override with
# TESTS_TIMEOUT_S, SWEEP_TIMEOUT_S, BREAKDOWN_TIMEOUT_S, CLI_TIMEOUT_S, SWEEP_BUDGET_S (the sweep stops starting rows after it: keep it
# ~60 s under SWEEP_TIMEOUT_S, which covers the placement check and the JSON).
# DEVICE_CHECK_DRY_RUN=1 runs stages 2 and 3 on the CPU (tests with gloo, a tiny sweep): a check of the
# script and the Python code before GPU time is spent; its numbers mean nothing.

set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
OUT=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT" || exit 2
# stage logs are appended to (two stages share gpu_check.log: at most 8 files come back from a lent
# machine); start them empty
rm -f "$OUT"/env.txt "$OUT"/tests.log "$OUT"/gpu_check.log "$OUT"/cli.log
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MODELPAR_AUTO_CALIBRATE=0
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-180}
SWEEP_TIMEOUT_S=${SWEEP_TIMEOUT_S:-255}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-195}
DRY=${DEVICE_CHECK_DRY_RUN:-0}

declare -a NAMES=() CODES=() SECS=()
record() {   # name, exit status, seconds
    NAMES+=("$1"); CODES+=("$2"); SECS+=("$3")
}

# run_stage NAME TIMEOUT_S LOGFILE CMD...: the command under timeout, its output shown and tee'd
run_stage() {
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    local shown="$*"
    shown=${shown//$'\n'/ }
    [ "${#shown}" -gt 160 ] && shown="${shown:0:160} ..."
    echo "=== stage $name (timeout ${limit} s): $shown" | tee -a "$log"
    t0=$(date +%s)
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "=== stage $name: TIMED OUT after ${limit} s (exit $rc)" | tee -a "$log"
    fi
    record "$name" "$rc" "$(( $(date +%s) - t0 ))"
}

summary() {   # returns 1 when a stage failed or timed out (decided here, not in the piped block: a
              # pipeline's parts run in subshells, whose assignments are lost; it always returned 0)
    local i status all=0
    for i in "${!CODES[@]}"; do
        [ "${CODES[$i]}" -eq 0 ] || all=1
    done
    {
        echo "=== summary (output in $OUT)"
        for i in "${!NAMES[@]}"; do
            case ${CODES[$i]} in
                0) status=ok ;;
                124|137) status="TIMED OUT" ;;
                *) status=FAILED ;;
            esac
            printf '%-8s exit %3s  %4s s  %s\n' "${NAMES[$i]}" "${CODES[$i]}" "${SECS[$i]}" "$status"
        done
    } | tee "$OUT/summary.txt"
    return $all
}

# 1. environment
ENV_PY='
import importlib.util, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "| CUDA build", torch.version.cuda, "| available", torch.cuda.is_available())
def show(label, f):
    try:
        print(label, f())
    except Exception as e:
        print(label, "could not be read:", type(e).__name__, e)
if torch.cuda.is_available():
    show("device 0:", lambda: torch.cuda.get_device_name(0))
    show("properties:", lambda: torch.cuda.get_device_properties(0))
    show("device count:", torch.cuda.device_count)
    show("nccl version:", torch.cuda.nccl.version)
    show("nccl backend available:", lambda: torch.distributed.is_nccl_available())
    show("bf16 supported:", torch.cuda.is_bf16_supported)
def triton():
    from torch.utils._triton import has_triton
    return has_triton()
show("triton usable:", triton)
for m in ("pytest", "numpy", "yaml", "jsonargparse", "tqdm", "safetensors", "transformers", "rich"):
    print("  " + m + ":", "yes" if importlib.util.find_spec(m) else "no")
try:
    from modelpar.bench.gpu import TORCH_APIS, audit_torch_apis
    miss = audit_torch_apis()
    print("torch API audit:", len(TORCH_APIS) - len(miss), "of", len(TORCH_APIS), "present")
    for n, why in miss:
        print("  MISSING", n + ":", why)
except Exception as e:
    print("modelpar.bench.gpu does not import:", type(e).__name__, e)
    raise
'
run_stage env 45 "$OUT/env.txt" "$PY" -c "$ENV_PY"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 | tee -a "$OUT/env.txt"
fi
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    echo "device_check: '$PY -c \"import torch\"' fails; nothing else can run." | tee -a "$OUT/env.txt"
    summary
    exit 1
fi

if [ "$DRY" = "1" ]; then
    TEST_DEV=cpu; SWEEP_ARGS=(--device cpu --tiny)
    echo "device_check: DRY RUN on the CPU (DEVICE_CHECK_DRY_RUN=1): checks the script, not the GPU"
else
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        summary
        echo "device_check: no CUDA device (torch.cuda.is_available() is False): stages tests and sweep not run." \
            | tee -a "$OUT/summary.txt"
        exit 0
    fi
    TEST_DEV=cuda:0; SWEEP_ARGS=()
fi

# 2. GPU-marked tests: pytest where it imports, else the module's own runner
if [ "$DRY" != "1" ] && "$PY" -c 'import pytest' 2>/dev/null; then
    run_stage tests "$TESTS_TIMEOUT_S" "$OUT/tests.log" \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs -o addopts="" tests/test_gpu_runtime.py
else
    [ "$DRY" = "1" ] || echo "device_check: pytest is not installed; running the tests with their own runner"
    run_stage tests "$TESTS_TIMEOUT_S" "$OUT/tests.log" "$PY" tests/test_gpu_runtime.py --device "$TEST_DEV"
fi

# 3. the sweep (writes gpu_check.json after every row, and gpu_check.md at the end)
run_stage sweep "$SWEEP_TIMEOUT_S" "$OUT/gpu_check.log" \
    "$PY" benchmarks/gpu_check.py --out "$OUT" --budget-s "$SWEEP_BUDGET_S" ${SWEEP_ARGS[@]+"${SWEEP_ARGS[@]}"}

# 4. where the step time goes: kernel classes measured under torch.profiler beside the planner's inputs
run_stage breakdown "${BREAKDOWN_TIMEOUT_S:-120}" "$OUT/gpu_check.log" \
    "$PY" benchmarks/gpu_breakdown.py --out "$OUT" ${SWEEP_ARGS[@]+"${SWEEP_ARGS[@]}"}

# 5. the command line on the GPU (needs the CLI's dependencies, jsonargparse and docstring_parser, which the
#    lent machine's image lacks: carry their wheels, docs/planner.md "GPU check"): `modelpar train`, one rank,
#    the planner's pick, of a built-in GPT and of a Hugging Face Llama built from its config
if "$PY" -c 'import jsonargparse, docstring_parser' 2>/dev/null; then
    if [ "$DRY" = "1" ]; then
        CLI_GPT=gpt-nano; CLI_HF='{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}'
        CLI_STEPS="10 10"    # a check of the commands on 2 loaded CPU cores (60 + 40 steps timed out there)
    else
        CLI_STEPS="60 40"
        CLI_GPT=gpt-100m; CLI_HF='{"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 256}'
    fi
    CLI_RUNS=$(mktemp -d)   # run folders stay out of $OUT (what comes back is capped at 8 files)
    read -r GPT_STEPS HF_STEPS <<< "$CLI_STEPS"
    run_stage cli "${CLI_TIMEOUT_S:-150}" "$OUT/cli.log" bash -c '
        set -e
        "$0" -m modelpar train --model "$1" --nproc 1 --steps "$4" --eval-every $(( $4 / 2 )) --out-dir "$3"
        "$0" -m modelpar train --model hf:llama --model-config "$2" --nproc 1 --steps "$5" --eval-every $(( $5 / 2 )) \
            --out-dir "$3"' "$PY" "$CLI_GPT" "$CLI_HF" "$CLI_RUNS" "$GPT_STEPS" "$HF_STEPS"
else
    echo "device_check: jsonargparse / docstring_parser do not import: stage cli not run"
fi

summary
exit $?
