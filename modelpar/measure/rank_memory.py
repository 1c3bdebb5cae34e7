"""Per-rank peak memory of pipeline schedules, measured by `modelpar train` and predicted by the planner:
the configurations, the measurement and the prediction `benchmarks/pipeline_rank_memory.py` tabulates and
``tests/test_vschedule_memory.py`` checks (one definition for both).

`measure` trains 3 steps with ``modelpar train --track-memory`` (the second step measured with
`modelpar.train.metrics.StepMemory`, as every pipeline run is) and reads each rank's peak from the run's
``summary.json`` (``peak_tensor_bytes_per_rank``); `predict` is `modelpar.planner.memory.rank_memory` of
every pipeline rank for the same layout (the planner's stage split, which `train` runs too), gloo
collectives, fused AdamW.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2 ** 20
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
GPT8 = {"n_layer": 8}
# (model, --model-config, seq_len, micro-batch size, label)
MODELS = {"gpt1m": ("gpt-1m", {}, 0, 4), "gpt1m-8l": ("gpt-1m", GPT8, 0, 4), "llama": ("hf:llama", LLAMA, 64, 4)}


def configs() -> list[dict]:
    out = []
    for key, pp in (("gpt1m", 2), ("gpt1m-8l", 4), ("llama", 2), ("llama", 4)):
        for sched, v in (("zbvzerobubble", 2), ("dualpipev", 2), ("1f1b", 1), ("interleaved1f1b", 2),
                         ("interleavedzerobubble", 2)):
            for k in (1, 2, 3):
                m = k * pp
                if sched == "dualpipev" and m < 2 * pp:
                    continue
                if key == "llama" and k == 3:
                    continue
                model, cfg, seq, b = MODELS[key]
                out.append({"name": f"{key}-pp{pp}-{sched}-m{m}", "model": model, "model_config": cfg,
                            "seq_len": seq, "pp": pp, "schedule": sched, "v": v, "m": m, "b": b})
    # activation checkpointing under every schedule with a split backward (and 1f1b, the control): full on
    # both models, every second block on the 8-layer GPT
    for key, pp, ac, k in (("gpt1m-8l", 4, "full", 1), ("llama", 2, "full", 1), ("gpt1m-8l", 2, "every-k", 2)):
        model, cfg, seq, b = MODELS[key]
        for sched, v in (("zbvzerobubble", 2), ("dualpipev", 2), ("interleavedzerobubble", 2), ("1f1b", 1)):
            m = 2 * pp
            out.append({"name": f"{key}-pp{pp}-{sched}-m{m}-{ac}{k if ac == 'every-k' else ''}", "model": model,
                        "model_config": cfg, "seq_len": seq, "pp": pp, "schedule": sched, "v": v, "m": m, "b": b,
                        "ac": ac, "ac_every": k})
    return out


def _layout(c: dict) -> list[str]:
    return ["--pp", str(c["pp"]), "--pp-schedule", c["schedule"], "--virtual-stages", str(c["v"]),
            "--n-microbatches", str(c["m"]), "--global-batch-size", str(c["m"] * c["b"]), "--nproc", str(c["pp"]),
            "--activation-checkpointing", c.get("ac", "none"), "--ac-every", str(c.get("ac_every", 1))]


def measure(c: dict) -> list[int]:
    """Each rank's peak tensor bytes of the measured step of ``modelpar train`` for configuration ``c``."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "modelpar", "train", "--model", c["model"], "--steps", "3", "--track-memory",
               "--out-dir", d, "--sample-bytes", "0", "--eval-samples", str(c["m"] * c["b"]), "--log-every", "1",
               *_layout(c)]
        if c["model_config"]:
            cmd += ["--model-config", json.dumps(c["model_config"])]
        if c["seq_len"]:
            cmd += ["--seq-len", str(c["seq_len"])]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        runs = list(Path(d).iterdir())
        if r.returncode or not runs:
            raise RuntimeError(f"{c['name']}: train failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return json.loads((runs[0] / "summary.json").read_text())["peak_tensor_bytes_per_rank"]


def predict(c: dict) -> list[float]:
    """The planner's peak of every pipeline rank (bytes), as `estimate_memory` computes each."""
    from modelpar.cli.common import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.loads import rank_loads
    from modelpar.planner.memory import Batch, rank_memory

    plan = ParallelPlan(pp=c["pp"], pp_schedule=c["schedule"], virtual_stages=c["v"], n_microbatches=c["m"],
                        activation_checkpointing=c.get("ac", "none"), ac_every=c.get("ac_every", 1))
    prof = profile_for(c["model"], c["model_config"], c["seq_len"], "fp32")[0]     # as `estimate` profiles it
    batch = Batch(c["m"] * c["b"], c["m"] * c["b"])
    loads = rank_loads(prof, plan, act_bytes=4)
    return [rank_memory(ld, plan, micro_batch_size=c["b"], optimizer="adamw", overhead_bytes=0.0, pp_rank=r,
                        global_batch_size=batch.global_batch_size, gloo=True).total for r, ld in enumerate(loads)]
