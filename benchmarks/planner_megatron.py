"""Check the planner against published Megatron-LM runs (Narayanan et al. SC'21, Table 1).

For each row of ../shared/reference/megatron.md: profile a GPT of that shape on the meta device
(bf16), predict the step time of the published layout (TP, PP, DP = GPUs / (TP x PP), full
recomputation, interleaved 1F1B where PP > 1) on the built-in A100-80GB profile, whose achievable
GEMM fraction comes from a published large-GEMM benchmark (MAMF, see modelpar/planner/hardware.py),
not from these rows. Megatron 2021 all-reduced data-parallel gradients after the backward pass, so
the check runs with ``dp_overlap=False``, and with a fused Adam on tensor-parallel ranks too
(``fused_tp_optimizer=True``: Megatron-LM used apex's FusedAdam). The micro-batch size (not published in the table) and the
number of virtual stages are chosen as the planner would: the fastest feasible one.

Achieved TFLOP/s per GPU uses the paper's own FLOP count, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
divided by the predicted iteration time x GPUs.

Run: ``.venv/bin/python benchmarks/planner_megatron.py``
"""

from __future__ import annotations

import sys
import time

import torch

from modelpar.models.gpt import GPT, GPTConfig
from modelpar.plan import ParallelPlan
from modelpar.planner.cost import estimate_step
from modelpar.planner.hardware import BUILTIN
from modelpar.planner.memory import Batch, estimate_memory
from modelpar.planner.profile import profile_model

V, S = 51200, 2048
# params (B), heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0)]


def paper_flops(B: int, l: int, h: int) -> float:
    """FLOPs per iteration with full recomputation (Narayanan et al. SC'21, Eq. 3)."""
    return 96 * B * S * l * h * h * (1 + S / (6 * h) + V / (16 * l * h))


def megatron_profile(a: int, h: int, l: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=V, seq_len=S, n_layer=l, n_head=a, d_model=h))
    x = torch.zeros(1, S, dtype=torch.long, device="meta")
    return profile_model(model, x, dtype=torch.bfloat16, attention="math")   # unfused, as Megatron-LM 2021


def predict_row(row, hw=BUILTIN["A100-80GB"]) -> dict:
    """Best feasible prediction for the published layout of one row (see module docstring)."""
    _, a, h, l, tp, pp, gpus, B, published = row
    prof = megatron_profile(a, h, l)
    dp = gpus // (tp * pp)
    per_dp = B // dp
    best = None
    vs = [v for v in range(2, l // pp + 1) if (l // pp) % v == 0] if pp > 1 else [1]
    for v in vs:
        for b in [d for d in (1, 2, 4, 8, 16, 32) if per_dp % d == 0]:
            m = per_dp // b if pp > 1 else 1
            if pp > 1 and m % pp:
                continue
            plan = ParallelPlan(dp_replicate=dp, tp=tp, pp=pp, n_microbatches=m, virtual_stages=v,
                                pp_schedule="interleaved1f1b" if pp > 1 else "1f1b",
                                activation_checkpointing="full", precision="bf16")
            batch = Batch(B, per_dp if pp > 1 else b)
            mem = estimate_memory(prof, plan, batch, optimizer="adamw",
                                  overhead_bytes=hw.framework_overhead_bytes, recv_per_microbatch=False,
                                  fused_tp_optimizer=True)
            if mem.total > hw.memory_bytes:
                continue
            st = estimate_step(prof, plan, batch, hw, optimizer="adamw", dp_overlap=False, fused_tp_optimizer=True)
            if best is None or st.total < best[2].total:
                best = (plan, b, st, mem)
    plan, b, st, mem = best
    achieved = paper_flops(B, l, h) / (st.total * gpus) / 1e12
    return {"row": row, "plan": plan, "micro_batch": b, "step": st, "memory": mem,
            "predicted_tflops": achieved, "published_tflops": published,
            "error": achieved / published - 1}


def main() -> int:
    t0 = time.perf_counter()
    worst = 0.0
    print(f"{'params':>7} {'layout':<34} {'b':>3} {'pred TF/s':>9} {'pub':>5} {'err':>7} "
          f"{'compute':>8} {'comm':>6} {'bubble':>6} {'mem GiB':>8}")
    for row in ROWS:
        r = predict_row(row)
        st = r["step"]
        worst = max(worst, abs(r["error"]))
        print(f"{row[0]:>6}B {r['plan'].describe():<34} {r['micro_batch']:>3} {r['predicted_tflops']:>9.1f} "
              f"{row[-1]:>5.0f} {r['error']:>+7.1%} {st.compute_share:>8.1%} {st.comm_share:>6.1%} "
              f"{st.bubble_share:>6.1%} {r['memory'].total / 2**30:>8.1f}")
    print(f"largest error {worst:.1%} (goal <= 15%); {time.perf_counter() - t0:.1f} s")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
