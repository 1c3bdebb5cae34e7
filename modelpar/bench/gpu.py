"""The GPU check's measurements (`benchmarks/gpu_check.py` prints them on a CUDA machine): training
MFU, the planner's one-device bf16 prediction, timed one-device training steps, and placement parity
(blocks split over two devices against one device). Every function also runs on CPU (``"cpu"``
devices), which is how the test suite checks them."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

GOAL_MFU = 0.45
DENSE_BF16_PEAK = 989e12        # H100 / H200 SXM dense bf16 (NVIDIA datasheets)



def _timed_step(pm, opt, x, y, dev: torch.device) -> tuple[float, torch.Tensor]:
    """One optimizer step (forward + backward, ``opt.step``, zero grads) and its wall seconds, the
    device synchronised before and after on CUDA (kernels are asynchronous)."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    loss = pm.forward_backward(x, y)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t, loss

def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def hardware_for_device(name: str, total_memory: int = 0):
    """The built-in profile matching a CUDA device name (`modelpar.planner.hardware.hardware_for_device`)."""
    from modelpar.planner.hardware import hardware_for_device as lookup
    return lookup(name, total_memory)


def mfu(model_flops_per_step: float, step_s: float, peak: float) -> float:
    """Model FLOPs utilization (PaLM App. B): FLOPs per step / (seconds per step x peak FLOP/s)."""
    return model_flops_per_step / (step_s * peak)


def predict(model_name: str, micro_batch: int, hw):
    """(profile, predicted MemoryEstimate, predicted StepEstimate) of one-device bf16 training."""
    from modelpar.models import build_model
    from modelpar.plan import ParallelPlan
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.profile import profile_model
    m = build_model(model_name, device="meta")
    prof = profile_model(m, torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta"),
                         dtype=torch.bfloat16, attention="flash")
    plan = ParallelPlan(precision="bf16")
    batch = Batch(micro_batch, micro_batch)
    return (prof, estimate_memory(prof, plan, batch, optimizer="adamw"),
            estimate_step(prof, plan, batch, hw, optimizer="adamw"))


def train_steps(model_name: str, device: str, *, micro_batch: int, steps: int, precision: str = "bf16",
                compile_model: bool = False, seed: int = 0) -> dict:
    """Train ``steps`` steps of one-device training; returns step seconds, step-3 peak bytes (CUDA) and losses."""
    from modelpar.models import build_model
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan

    dev = torch.device(device)
    model = build_model(model_name, device="cpu", seed=seed)
    if compile_model:
        for blk in model.blocks:
            blk.compile()
    pm = parallelize(model, ParallelPlan(precision=precision), MeshInfo(None), loss_fn=lm_loss, device=dev)
    from modelpar.train.step import make_optimizer
    opt = make_optimizer(model.parameters(), "adamw", lr=1e-4, weight_decay=0.1)   # `modelpar train`'s builder
    g = torch.Generator().manual_seed(seed)
    seq = model.cfg.seq_len
    x = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq), generator=g).to(dev)
    y = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq), generator=g).to(dev)
    times, losses, peak = [], [], 0
    cuda = dev.type == "cuda"
    for i in range(steps):
        if cuda and i == 2:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        dt, loss = _timed_step(pm, opt, x, y, dev)
        times.append(dt)
        losses.append(float(loss))
        if cuda and i == 2:
            peak = torch.cuda.max_memory_allocated(dev)
    return {"times": times, "median_s": statistics.median(times[2:] or times), "peak_bytes": peak, "losses": losses}


def placement_check(devices=("cpu", "cuda:0"), *, model_name: str = "gpt-3m", steps: int = 3,
                    batch: int = 4, seed: int = 0) -> dict:
    """Train ``model_name`` with its blocks split over ``devices`` and on ``devices[0]`` alone
    (fp32, SGD, same data); returns both loss lists and the largest relative loss difference."""
    from modelpar.models import build_model
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan
    from modelpar.train.step import make_optimizer

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ref_model = build_model(model_name, device="cpu", seed=seed)
    split_model = copy.deepcopy(ref_model)
    ref = parallelize(ref_model, ParallelPlan(), MeshInfo(None), loss_fn=lm_loss, device=torch.device(devices[0]))
    split = parallelize(split_model, ParallelPlan(placement_devices=tuple(devices)), MeshInfo(None),
                        loss_fn=lm_loss, device=torch.device(devices[0]))
    g = torch.Generator().manual_seed(seed + 1)
    seq = ref_model.cfg.seq_len
    out = {}
    for name, pm, mod in (("reference", ref, ref_model), ("placement", split, split_model)):
        opt = make_optimizer(mod.parameters(), "sgd", lr=0.1)
        g.manual_seed(seed + 1)
        losses = []
        for _ in range(steps):
            x = torch.randint(0, 256, (batch, seq), generator=g)
            y = torch.randint(0, 256, (batch, seq), generator=g)
            losses.append(float(pm.forward_backward(x, y)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = losses
    diff = max(abs(a - b) / abs(a) for a, b in zip(out["reference"], out["placement"]))
    return {**out, "max_rel_diff": diff, "devices": list(devices)}


# ---- the GPU sweep (`benchmarks/gpu_check.py`): GPTs of ~125M, ~1B, ~3B in bf16, with and without checkpointing --

# name -> (base preset, overrides). GPT-3-style shapes (Brown et al. 2020, Table 2.1) with a
# 50,304-token vocabulary (GPT-2's 50,257 padded to a multiple of 64, as nanoGPT and Megatron pad)
# and a tied output layer, so the parameter counts are the familiar ones: 124M, 1.02B, 2.91B.
# ``seq_len`` is set per row (the position table has that many rows).
SWEEP_MODELS: dict[str, tuple[str, dict]] = {
    "gpt-125m": ("gpt-100m", dict(vocab_size=50304, tie_embeddings=True)),          # 12 x 768, 12 heads
    "gpt-1b": ("gpt-1b", dict(vocab_size=50304, tie_embeddings=True)),              # 24 x 1792, 16 heads
    "gpt-3b": ("gpt-2b", dict(n_layer=32, n_head=21, d_model=2688, vocab_size=50304,
                              tie_embeddings=True)),                                # 32 x 2688, 21 x 128
}
# the tiny rows (`benchmarks/gpu_check.py`'s tiny mode): the same code path on a model that runs in
# seconds on a CPU (a dry run before GPU time)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "tiny": ("gpt-nano", dict(vocab_size=512, tie_embeddings=True)),
}
SWEEP_SEQS = (1024, 4096)
SWEEP_AC = ("none", "full")
TINY_SEQS = (32, 64)


def sweep_config(name: str, seq: int, *, models: dict | None = None):
    """The `GPTConfig` of sweep row ``name`` with ``seq`` positions (builds nothing)."""
    from modelpar.models.gpt import PRESETS, GPTConfig
    base, over = (models or {**SWEEP_MODELS, **TINY_MODELS})[name]
    return GPTConfig(**{**PRESETS[base].__dict__, **over, "seq_len": seq})


def sweep_model(name: str, seq: int, device: str = "meta", *, models: dict | None = None, seed: int = 0):
    """The GPT of sweep row ``name`` with ``seq`` positions on ``device`` (weights initialised there)."""
    from modelpar.models import build_model
    base, over = (models or {**SWEEP_MODELS, **TINY_MODELS})[name]
    return build_model(base, device=device, seed=None if device == "meta" else seed, **{**over, "seq_len": seq})


_PROFILES: dict = {}


def row_profile(name: str, seq: int, *, models: dict | None = None):
    """The planner's bf16 profile of sweep row ``name`` at ``seq`` tokens, with its autocast variant
    (one device trains under autocast: `modelpar.plan.autocasts`), for one sample; memoized per shape
    (it does not depend on the checkpointing mode)."""
    from modelpar.planner.profile import profile_model
    key = (name, seq, repr((models or {**SWEEP_MODELS, **TINY_MODELS})[name]))
    prof = _PROFILES.get(key)
    if prof is None:
        m = sweep_model(name, seq, "meta", models=models)
        prof = _PROFILES[key] = profile_model(m, torch.zeros(1, seq, dtype=torch.long, device="meta"),
                                              dtype=torch.bfloat16, attention="flash", autocast=True)
    return prof


def predict_row(name: str, seq: int, micro_batch: int, ac: str, hw, *, models: dict | None = None) -> dict:
    """The planner's one-device bf16 prediction of one sweep row (fused AdamW, fused attention):
    step seconds by part, peak bytes by part, model FLOPs per step and the parameter count."""
    from modelpar.plan import ParallelPlan
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch, estimate_memory
    prof = row_profile(name, seq, models=models)
    plan = ParallelPlan(precision="bf16", activation_checkpointing=ac)
    batch = Batch(micro_batch, micro_batch)
    mem = estimate_memory(prof, plan, batch, optimizer="adamw")
    step = estimate_step(prof, plan, batch, hw, optimizer="adamw")
    return {"params": prof.num_params, "model_flops": step.model_flops, "hardware_flops": step.hardware_flops,
            "step_s": step.total, "step_parts_s": step.parts(), "peak_bytes": mem.total,
            "memory_parts_bytes": mem.parts(), "memory_phase": mem.phase}


def matmul_flops(device: str = "cuda:0", n: int = 8192, reps: int = 10, dtype=torch.bfloat16) -> float:
    """Achieved FLOP/s of an ``n`` x ``n`` x ``n`` matmul on ``device`` (random data, 3 warm-ups, mean of
    ``reps``): the ceiling a training step can reach there, beside the datasheet peak."""
    dev = torch.device(device)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def _oom_types() -> tuple[type, ...]:
    return tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


def measure_row(name: str, seq: int, micro_batch: int, ac: str, device: str, *, steps: int = 4,
                warmup: int = 2, models: dict | None = None, seed: int = 0, deadline: float | None = None) -> dict:
    """Train one sweep row on one device: bf16 autocast (fp32 master weights), fused AdamW, the plan's
    checkpointing, as `modelpar train` runs it (`parallelize` + `train.step.make_optimizer`: fused AdamW,
    decay on matrices only).

    Returns ``{"times_s": [...timed steps], "median_s", "peak_bytes", "static_bytes", "losses"}``:
    ``peak_bytes`` = ``torch.cuda.max_memory_allocated`` over the timed steps (stats reset after the
    ``warmup`` steps, which are excluded; 0 on CPU), ``static_bytes`` = ``memory_allocated`` after the
    warm-up (weights + optimizer state; gradients are freed by ``zero_grad``). Stops timing early
    (fewer steps, ``"cut": True``) once ``deadline`` (``time.monotonic()``) has passed.
    Raises torch's OutOfMemoryError when the row does not fit (the caller reports it).
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    pm, opt, x, y = row_setup(name, seq, micro_batch, ac, dev, models=models, seed=seed)
    times, losses, peak, static, cut = [], [], 0, 0, False
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.synchronize(dev)
            static = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if i >= warmup + 1 and deadline is not None and time.monotonic() > deadline:
            cut = True
            break
        dt, loss = _timed_step(pm, opt, x, y, dev)
        losses.append(float(loss))
        if i >= warmup:
            times.append(dt)
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev)
    return {"times_s": times, "median_s": statistics.median(times), "peak_bytes": peak,
            "static_bytes": static, "losses": losses, "cut": cut}


def row_setup(name: str, seq: int, micro_batch: int, ac: str, dev: torch.device, *, models: dict | None = None,
              seed: int = 0, loss_fn=lm_loss):
    """``(ParallelModel, optimizer, x, y)`` of one sweep row on ``dev`` as `modelpar train` builds them:
    bf16 with the row's checkpointing (`parallelize`), fused AdamW with decay on matrices
    (`train.step.make_optimizer`), one random batch of ``micro_batch`` sequences of ``seq`` tokens."""
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan
    from modelpar.train.step import make_optimizer

    model = sweep_model(name, seq, str(dev), models=models, seed=seed)
    pm = parallelize(model, ParallelPlan(precision="bf16", activation_checkpointing=ac), MeshInfo(None),
                     loss_fn=loss_fn, device=dev)
    opt = make_optimizer(model.parameters(), "adamw", lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, model.cfg.vocab_size, (micro_batch, seq), generator=g).to(dev) for _ in range(2))
    return pm, opt, x, y


def _free(device: str) -> None:
    import gc
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sweep_rows(models: dict, seqs=SWEEP_SEQS, acs=SWEEP_AC, tokens: int = 16384) -> list[tuple[str, int, int, str]]:
    """(model, seq, micro-batch, checkpointing) of every row, smallest model first; the micro-batch
    gives every row ``tokens`` tokens per step (at least one sequence)."""
    return [(n, s, max(1, tokens // s), a) for n in models for s in seqs for a in acs]


def run_sweep(rows, device: str, hw, *, budget_s: float = 300.0, steps: int = 4, warmup: int = 2,
              models: dict | None = None, peak_flops: float = DENSE_BF16_PEAK, log=print,
              on_row=None) -> dict:
    """Measure and predict every row in ``rows`` within ``budget_s`` seconds of wall time.

    A row starts only if the time left covers its predicted cost (``warmup + steps`` predicted steps,
    x 3 for the first-step and build overheads the planner does not model, + 5 s); otherwise it is
    reported ``"skipped: over budget"``, and so are all later rows. A row that runs out of device
    memory is reported ``"oom"`` (its memory is freed, the sweep goes on); any other exception is
    reported ``"error: ..."`` and the sweep goes on. ``on_row(result)`` is called after every row
    (e.g. to save the partial result, in case the process is killed).

    Returns ``{"device", "hardware", "peak_flops", "budget_s", "elapsed_s", "over_budget", "rows": [...]}``;
    each row has the prediction (`predict_row`), the measurement (`measure_row`), and
    ``step_error`` / ``memory_error`` = predicted / measured - 1, ``mfu`` / ``mfu_predicted`` =
    model FLOPs per step / (step seconds x ``peak_flops``) (PaLM App. B), ``tokens_per_s``.
    """
    start = time.monotonic()
    deadline = start + budget_s
    out = {"device": device, "hardware": hw.name, "peak_flops": peak_flops, "budget_s": budget_s,
           "over_budget": False, "rows": []}
    for name, seq, mb, ac in rows:
        row = {"model": name, "seq": seq, "micro_batch": mb, "ac": ac, "status": "ok"}
        out["rows"].append(row)
        try:
            row.update(predict=predict_row(name, seq, mb, ac, hw, models=models))
        except Exception as e:       # noqa: BLE001 -- a prediction bug must not cost the measurement
            row["predict_error"] = f"{type(e).__name__}: {e}"
        pred = row.get("predict", {})
        cost = 3 * (warmup + steps) * pred.get("step_s", 1.0) + 5.0
        left = deadline - time.monotonic()
        if out["over_budget"] or cost > left:
            out["over_budget"] = True
            row["status"] = f"skipped: over budget ({left:.0f} s left, row needs ~{cost:.0f} s)"
            log(_row_line(row))
            if on_row is not None:
                on_row(out)
            continue
        failed = None
        try:
            row["measured"] = measure_row(name, seq, mb, ac, device, steps=steps, warmup=warmup, models=models,
                                          deadline=deadline)
        except _oom_types() as e:
            failed = "oom: " + str(e).splitlines()[0][:200]
        except Exception as e:       # noqa: BLE001 -- report and go on with the next row
            failed = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if failed is not None:
            row["status"] = failed
        _free(device)                # outside the except block: its traceback holds the row's tensors
        _score(row, peak_flops)
        log(_row_line(row))
        out["elapsed_s"] = time.monotonic() - start
        if on_row is not None:
            on_row(out)
    out["elapsed_s"] = time.monotonic() - start
    return out


def _score(row: dict, peak_flops: float) -> None:
    """A row's MFU (measured and predicted), tokens/s and prediction errors (predicted / measured - 1),
    where it has both a measurement and a prediction."""
    meas, pred = row.get("measured"), row.get("predict")
    if not (meas and pred):
        return
    t = meas["median_s"]
    row["mfu"] = mfu(pred["model_flops"], t, peak_flops)
    row["mfu_predicted"] = mfu(pred["model_flops"], pred["step_s"], peak_flops)
    row["step_error"] = pred["step_s"] / t - 1
    row["tokens_per_s"] = row["micro_batch"] * row["seq"] / t
    if meas["peak_bytes"]:
        row["memory_error"] = pred["peak_bytes"] / meas["peak_bytes"] - 1


def replay(result: dict, *, log=print) -> dict:
    """A recorded sweep (`run_sweep`'s result, e.g. a lent GPU's ``gpu_check.json``) re-predicted by
    this planner: every row's measurement kept, its prediction and errors recomputed on the recorded
    hardware profile (`planner.hardware.BUILTIN`). Lets a planner change be checked against GPU
    measurements on a machine without a GPU. Returns the new result; rows are logged as they go."""
    from modelpar.planner.hardware import BUILTIN
    hw = BUILTIN[result["hardware"]]
    out = {**result, "rows": [], "replayed_from": result.get("where", "")}
    for old in result["rows"]:
        row = {k: old[k] for k in ("model", "seq", "micro_batch", "ac", "status", "measured") if k in old}
        row["predict"] = predict_row(row["model"], row["seq"], row["micro_batch"], row["ac"], hw)
        _score(row, result["peak_flops"])
        out["rows"].append(row)
        log(_row_line(row))
    return out


def _row_line(r: dict) -> str:
    p, m = r.get("predict", {}), r.get("measured", {})
    gib = 2 ** 30
    head = f"{r['model']:>9} {p.get('params', 0) / 1e9:5.2f}B seq {r['seq']:>5} x{r['micro_batch']:<3} ac {r['ac']:<5}"
    if not m:
        return f"{head} | {r['status']}" + (f" | predict: {r['predict_error']}" if "predict_error" in r else "")

    def pct(k):
        return f"{r[k]:+7.1%}" if k in r else "    n/a"
    return (f"{head} | step {m['median_s'] * 1e3:8.1f} ms pred {p.get('step_s', float('nan')) * 1e3:8.1f} {pct('step_error')}"
            f" | peak {m['peak_bytes'] / gib:6.2f} GiB pred {p.get('peak_bytes', float('nan')) / gib:6.2f} {pct('memory_error')}"
            f" | MFU {r.get('mfu', float('nan')):6.1%} pred {r.get('mfu_predicted', float('nan')):6.1%}"
            f" | {r.get('tokens_per_s', 0):9.0f} tok/s" + (" | cut short" if m.get("cut") else ""))


def sweep_table(result: dict) -> str:
    """The sweep as a markdown table (one line per row; the numbers of `_row_line`)."""
    gib = 2 ** 30
    lines = [f"device {result['device']}, planner profile {result['hardware']}, MFU against "
             f"{result['peak_flops'] / 1e12:.0f} TFLOP/s, {result.get('elapsed_s', 0):.0f} s of {result['budget_s']:.0f} s budget"
             + (" (OVER BUDGET: later rows skipped)" if result["over_budget"] else ""), "",
             "| model | params | seq x mb | ckpt | step ms | pred ms | err | peak GiB | pred GiB | err | MFU | pred MFU | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p, m = r.get("predict", {}), r.get("measured", {})

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        lines.append("| " + " | ".join([
            r["model"], f(p.get("params", 0) / 1e9 if p else None, ".2f") + "B", f"{r['seq']} x {r['micro_batch']}", r["ac"],
            f(m.get("median_s", 0) * 1e3 if m else None, ".1f"), f(p.get("step_s", 0) * 1e3 if p else None, ".1f"),
            f(r.get("step_error"), "+.1%"), f(m.get("peak_bytes", 0) / gib if m else None, ".2f"),
            f(p.get("peak_bytes", 0) / gib if p else None, ".2f"), f(r.get("memory_error"), "+.1%"),
            f(r.get("mfu"), ".1%"), f(r.get("mfu_predicted"), ".1%"), r["status"]]) + " |")
    return "\n".join(lines)


# ---- torch API audit: every torch API the GPU check's paths use, by import path ----------------------
# (module, attribute or None). The project requires torch >= 2.11 (pyproject.toml); the GPU machine
# runs torch 2.11 while the development machine runs 2.13, so device_check.sh prints this first.
TORCH_APIS: tuple[tuple[str, str | None], ...] = (
    ("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy"), ("torch.distributed.fsdp", "CPUOffloadPolicy"),
    ("torch.distributed.fsdp", "OffloadPolicy"),
    ("torch.distributed._composable.replicate_with_fsdp", "replicate"),
    ("torch.distributed.device_mesh", "init_device_mesh"),
    ("torch.distributed.tensor", "DTensor"), ("torch.distributed.tensor", "distribute_tensor"),
    ("torch.distributed.tensor", "Shard"), ("torch.distributed.tensor", "Replicate"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.tensor.parallel", "parallelize_module"), ("torch.distributed.tensor.parallel", "loss_parallel"),
    ("torch.distributed.tensor.parallel", "ColwiseParallel"), ("torch.distributed.tensor.parallel", "RowwiseParallel"),
    ("torch.distributed.tensor.parallel", "PrepareModuleInput"),
    ("torch.distributed.tensor.parallel", "PrepareModuleOutput"),
    ("torch.distributed.pipelining", "PipelineStage"),
    ("torch.distributed.pipelining.schedules", "ScheduleGPipe"), ("torch.distributed.pipelining.schedules", "Schedule1F1B"),
    ("torch.distributed.pipelining.schedules", "ScheduleInterleaved1F1B"),
    ("torch.distributed.pipelining.schedules", "ScheduleLoopedBFS"),
    ("torch.distributed.pipelining.schedules", "ScheduleInterleavedZeroBubble"),
    ("torch.distributed.pipelining.schedules", "ScheduleZBVZeroBubble"),
    ("torch.distributed.pipelining.schedules", "ScheduleDualPipeV"),
    ("torch.distributed.pipelining._backward", "stage_backward_input"),
    ("torch.distributed.pipelining._backward", "stage_backward_weight"),
    ("torch.distributed.checkpoint", "save"), ("torch.distributed.checkpoint", "load"),
    ("torch.distributed.checkpoint", "async_save"),
    ("torch.distributed.checkpoint.state_dict", "get_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "StateDictOptions"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed._tools.mem_tracker", "MemTracker"),
    ("torch.nn.parallel", "DistributedDataParallel"),
    ("torch.utils.checkpoint", "checkpoint"),
    ("torch.utils.flop_counter", "FlopCounterMode"), ("torch.utils.flop_counter", "sdpa_flop_count"),
    ("torch.utils.module_tracker", "ModuleTracker"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.utils._triton", "has_triton"),
    ("torch", "OutOfMemoryError"),
)


def audit_torch_apis(apis=TORCH_APIS) -> list[tuple[str, str]]:
    """The entries of ``apis`` this torch lacks: ``[(module.attr, why), ...]`` (empty: all present).
    Imports each module; nothing is called."""
    import importlib
    missing = []
    for mod, attr in apis:
        name = f"{mod}.{attr}" if attr else mod
        try:
            m = importlib.import_module(mod)
        except Exception as e:       # noqa: BLE001 -- any import failure is a finding
            missing.append((name, f"import {mod} failed: {type(e).__name__}: {e}"))
            continue
        if attr and not hasattr(m, attr):
            missing.append((name, f"{mod} has no {attr}"))
    return missing
