"""Strategy runs: one ``torch.distributed.run`` launch per row of the bench.

The launcher side (`run_row`) writes the row's spec as JSON, runs
``-m modelpar.bench.runner SPEC OUT`` on N ranks through `modelpar.launch.run_workers` with a hard
timeout, and reads the result JSON back; a row that fails or hangs becomes a row with
``status="failed"`` and the reason, never an exception. Every launch is separate, so an interrupted
bench keeps the rows already written.

Each rank (`worker_main`) builds the job exactly as ``modelpar train`` does (`preflight`, `build_task`,
`parallelize`, `build_optimizer`, `train_step`), with ``threads`` torch threads per rank, then:

1. ``warmup`` optimizer steps, not timed;
2. ``steps`` timed optimizer steps between barriers: samples/s = global batch x steps / wall time;
3. one step under ``torch.profiler`` (``record_shapes=True``): the communication profile (`comm`) and,
   for pipelines, each micro-batch's forward / backward per stage (the timeline);
4. one step under torch's MemTracker: peak tensor bytes per rank, by part.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modelpar.launch import exit_rank, write_json_atomic
from modelpar.train.metrics import StepMemory

PP_MARK = "modelpar.pp"       # record_function name prefix of pipeline actions: "modelpar.pp S F MB"

# row key -> (strategy shorthand, TrainConfig overrides, ranks: "n" | "hybrid" | 1, row label)
ROWS: dict[str, tuple[str, dict, object, str]] = {
    "single": ("single", {}, 1, "single device"),
    "placement": ("placement", {}, 1, "placement (2 devices, 1 process)"),
    "ddp": ("ddp", {}, "n", "ddp"),
    "fsdp": ("fsdp", {}, "n", "fsdp"),
    "tp": ("tp", {}, "n", "tp"),
    "pp": ("pp", {"pp_schedule": "1f1b"}, "n", "pp 1f1b"),
    "pp-gpipe": ("pp", {"pp_schedule": "gpipe"}, "n", "pp gpipe"),
    "pp-interleaved": ("pp", {"pp_schedule": "interleaved1f1b", "virtual_stages": 2}, "n", "pp interleaved1f1b (v=2)"),
    "hybrid": ("fsdp+tp", {}, "hybrid", "hybrid fsdp x tp"),
    "hsdp": ("hsdp", {}, "hybrid", "hsdp (replicate x shard)"),
    "auto": ("auto", {}, "n", "auto (planner)"),
}
DEFAULT_ROWS = ("single", "placement", "ddp", "fsdp", "tp", "pp", "pp-gpipe", "pp-interleaved", "hybrid", "auto")


@dataclass
class RowSpec:
    """One bench row: a strategy on a model, batch and rank count. Units: samples, steps, seconds."""

    key: str
    label: str
    model: str
    strategy: str
    nproc: int
    global_batch_size: int
    overrides: dict = field(default_factory=dict)
    seq_len: int = 0
    warmup: int = 2
    steps: int = 5
    threads: int = 1
    timeout_s: float = 300.0
    profile: bool = True             # run the profiled step (communication, pipeline timeline)
    track_memory: bool = True        # run the MemTracker step
    seed: int = 0
    note: str = ""
    model_config: dict = field(default_factory=dict)   # --model-config overrides (GPT preset or HF config)
    blocks: str = ""                 # --blocks: the block container's path (empty: found)
    split_points: str = ""           # --split-points: block paths that start a pipeline stage

    @property
    def row_id(self) -> str:
        """A file name: the model (``hf:gpt2``, ``path/config.json``) with other characters as ``_``."""
        import re

        return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.model)}__{self.key}__{self.nproc}"

    def train_config(self):
        from modelpar.train.config import TrainConfig

        return TrainConfig(model=self.model, strategy=self.strategy, nproc=self.nproc,
                           global_batch_size=self.global_batch_size, seq_len=self.seq_len, steps=max(1, self.steps),
                           threads=self.threads, seed=self.seed, timeout_s=min(self.timeout_s, 120.0),
                           dropout=0.0, sample_bytes=0, eval_every=0, model_config=dict(self.model_config),
                           blocks=self.blocks, split_points=self.split_points, **self.overrides)


def make_rows(model: str, keys, *, nproc: int, hybrid_nproc: int, global_batch_size: int, seq_len: int = 0,
              warmup: int = 2, steps: int = 5, threads: int = 1, timeout_s: float = 300.0,
              cores: int | None = None, model_config: dict | None = None, blocks: str = "",
              split_points: str = "") -> list[RowSpec]:
    """The rows of one model. Raises ValueError for an unknown row key (listing the valid ones)."""
    cores = cores or os.cpu_count() or 1
    rows = []
    for key in keys:
        if key not in ROWS:
            raise ValueError(f"unknown bench strategy {key!r}; valid: {', '.join(ROWS)}")
        strategy, ov, ranks, label = ROWS[key]
        n = nproc if ranks == "n" else hybrid_nproc if ranks == "hybrid" else 1
        note = ""
        if n * threads > cores:
            note = f"{n} ranks x {threads} thread(s) share {cores} cores"
        rows.append(RowSpec(key, label, model, strategy, n, global_batch_size, dict(ov), seq_len, warmup, steps,
                            threads, timeout_s, note=note, model_config=dict(model_config or {}),
                            blocks=blocks, split_points=split_points))
    return rows


def check_row(spec: RowSpec):
    """Everything that can be checked without processes (`preflight`): returns ``(plan, batches)``.

    Raises:
        ValueError / ImportError: the strategy cannot apply (the message is the skip reason).
    """
    from modelpar.train.loop import preflight

    world = 1 if spec.strategy in ("single", "placement") else spec.nproc
    return preflight(spec.train_config(), world)


# ---- launcher side -------------------------------------------------------------------------------
def run_row(spec: RowSpec, out_dir: Path, *, env: dict | None = None) -> dict:
    """Launch one row (`modelpar.launch.run_workers`, output to the row's log, killed at
    ``spec.timeout_s``) and return its result dict (``status`` "ok" or "failed" with ``reason``)."""
    from modelpar.launch import run_workers

    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / f"{spec.row_id}.spec.json"
    res_path = out_dir / f"{spec.row_id}.json"
    log_path = out_dir / f"{spec.row_id}.log"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    run = run_workers(["-m", "modelpar.bench.runner", str(spec_path), str(res_path)], spec.nproc, res_path,
                      timeout_s=spec.timeout_s, threads=spec.threads, env=env, log_path=log_path)
    if not run.timed_out and run.result is not None:
        # The result file is written (atomically, by rank 0) only after every rank's measurements
        # were gathered, so it is complete even when a rank then failed while shutting down.
        res = run.result
        res["launch_wall_s"] = run.wall_s
        if run.returncode != 0:
            res["exit_warning"] = (f"a rank exited with code {run.returncode} after the results were written "
                                   f"(see {log_path})")
        return res
    return {"status": "failed", "reason": run.reason(), "launch_wall_s": run.wall_s, "log": str(log_path)}


# ---- rank side -----------------------------------------------------------------------------------
def _mark_forward_backward(pm) -> None:
    """Wrap this ParallelModel's forward_backward in a profiler range (instance attribute only)."""
    from torch.profiler import record_function

    from modelpar.bench.comm import FWD_BWD_MARK

    orig = pm.forward_backward

    def forward_backward(*args, **kwargs):
        with record_function(FWD_BWD_MARK):
            return orig(*args, **kwargs)
    pm.forward_backward = forward_backward


def _mark_pipeline(schedule) -> None:
    """Wrap each local stage's forward / backward of one micro-batch in a profiler range named
    ``"modelpar.pp <stage> <F|B|I|W> <micro-batch>"`` (I: input-gradient half, W: weight half of a
    zero-bubble backward)."""
    from torch.profiler import record_function

    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for st in stages:
        for meth, tag in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                          ("backward_weight_one_chunk", "W")):
            orig = getattr(st, meth, None)
            if orig is None:
                continue

            def wrapped(chunk_id, *a, _orig=orig, _tag=tag, _s=st.stage_index, **k):
                t = "I" if _tag == "B" and k.get("full_backward", True) is False else _tag
                with record_function(f"{PP_MARK} {_s} {t} {chunk_id}"):
                    return _orig(chunk_id, *a, **k)
            setattr(st, meth, wrapped)


def _memory_parts(snapshot) -> dict[str, float]:
    """MemTracker peak snapshot -> bytes by part (parameters incl. buffers, gradients, optimizer,
    activations incl. temporaries), summed over devices."""
    parts = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "total": 0.0}
    for dev in snapshot.values():
        for k, v in dev.items():
            name = getattr(k, "value", k)
            slot = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
                    "Activation": "activations", "Temp": "activations", "Other": "activations",
                    "Total": "total"}.get(name)
            if slot:
                parts[slot] += float(v)
    return parts


def worker_main(argv: list[str]) -> int:
    """What each rank of a row runs: ``python -m modelpar.bench.runner SPEC_JSON RESULT_JSON``."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from modelpar.bench.comm import STEP_MARK, comm_profile, events_from_profiler
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh, get_device, init_distributed
    from modelpar.train.loop import build_optimizer, preflight
    from modelpar.train.metrics import peak_rss_bytes
    from modelpar.train.step import train_step
    from modelpar.train.task import build_task, example_input

    spec = RowSpec(**json.loads(Path(argv[0]).read_text()))
    cfg = spec.train_config()
    rank, world = init_distributed(cfg.timeout_s)
    torch.set_num_threads(spec.threads)
    plan, batches = preflight(cfg, world)
    device = get_device() if not plan.is_placement else torch.device(plan.placement_devices[0])
    task = build_task(cfg)
    nparams = sum(p.numel() for p in task.model.parameters())
    mesh = build_mesh(plan, device)
    pm = parallelize(task.model, plan, mesh, loss_fn=task.loss_fn, device=device,
                     example_input=example_input(task, batches.micro_batch_size))
    opt = build_optimizer(pm, cfg)
    _mark_forward_backward(pm)
    if pm.schedule is not None:
        _mark_pipeline(pm.schedule)
    sync = (lambda: dist.barrier()) if dist.is_initialized() and world > 1 else (lambda: None)
    cuda_sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_no = 0

    def one_step():
        nonlocal step_no
        xg, yg = task.train.global_batch(cfg.seed, step_no, batches.global_batch_size)
        step_no += 1
        loss_sum, n, _ = train_step(pm, opt, xg, yg, accum_steps=batches.accum_steps, grad_clip=cfg.grad_clip)
        return loss_sum.item() / n if n else None     # a tensor: train_step syncs nothing itself

    for _ in range(spec.warmup):
        one_step()
    cuda_sync()
    sync()
    step_times, loss = [], None
    t0 = time.perf_counter()
    for _ in range(spec.steps):
        ts = time.perf_counter()
        loss = one_step()
        cuda_sync()
        step_times.append(time.perf_counter() - ts)
    sync()
    measured_s = time.perf_counter() - t0

    comm, timeline = None, []
    if spec.profile:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            with record_function(STEP_MARK):
                one_step()
                cuda_sync()
        events = events_from_profiler(prof)
        comm = comm_profile(events).to_dict()
        for e in events:
            if e.name.startswith(PP_MARK + " "):
                _, s, t, mb = e.name.split()
                timeline.append({"rank": rank, "stage": int(s), "action": t, "mb": int(mb),
                                 "start_us": e.start_us, "dur_us": e.dur_us})
        sync()

    mem = None
    if spec.track_memory:
        from torch.distributed._tools.mem_tracker import MemTracker

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if pm.schedule is None:
            mt = MemTracker()
            try:
                mt.track_external(*pm.modules, opt)
            except Exception:            # untrackable wrappers: parts then fall into "activations"
                pass
            with mt:
                one_step()
            mem = _memory_parts(mt.get_tracker_snapshot("peak"))
            mem["method"] = "MemTracker"
        else:
            with StepMemory(pm.modules, opt) as sm:
                one_step()
            mem = sm.parts()
            mem["method"] = "StepMemory"
        if device.type == "cuda":
            mem["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(device))
        sync()

    mine = {"rank": rank, "step_times_s": step_times, "measured_s": measured_s, "comm": comm, "memory": mem,
            "peak_rss_bytes": peak_rss_bytes(), "timeline": timeline, "loss": loss,
            "stage_indices": list(pm.stage_indices)}
    gathered = [None] * world
    if dist.is_initialized() and world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        losses = [g["loss"] for g in gathered if g["loss"] is not None]
        slowest = max(g["measured_s"] for g in gathered)
        res = {"status": "ok", "spec": asdict(spec), "plan": plan.to_dict(), "plan_name": plan.describe(),
               "world_size": world, "device": device.type, "num_params": nparams,
               "global_batch_size": batches.global_batch_size, "local_batch_size": batches.local_batch_size,
               "micro_batch_size": batches.micro_batch_size, "accum_steps": batches.accum_steps,
               "tokens_per_sample": task.tokens_per_sample, "kind": task.kind,
               "measured_s": slowest, "step_s": slowest / max(1, spec.steps),
               "samples_per_s": batches.global_batch_size * spec.steps / slowest,
               "tokens_per_s": (batches.global_batch_size * spec.steps * task.tokens_per_sample / slowest
                                if task.kind == "lm" else None),
               "loss": losses[-1] if losses else None, "ranks": gathered,
               "torch": torch.__version__, "threads": spec.threads}
        write_json_atomic(argv[1], res)
    return 0


if __name__ == "__main__":
    exit_rank(worker_main(sys.argv[1:]))
