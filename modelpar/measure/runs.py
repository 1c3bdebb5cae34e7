"""Measure what the planner predicts: peak tensor memory by part, and step time, of real runs.

Used by the accuracy tests and benchmarks (``tests/test_planner_accuracy*.py``,
``benchmarks/planner_accuracy_*.py``, ``benchmarks/plan_quality.py``). Every rank of a torchrun
launch calls `run_cases`; each case builds the model, lays it out with
`modelpar.parallel.compose.parallelize` and trains with `modelpar.train.step.train_step`, so the
measured code is the code `modelpar train` runs.

Memory (CPU): torch's MemTracker (``torch.distributed._tools.mem_tracker``, a private API pinned by
``tests/test_planner_accuracy.py``) is entered *before* the model is built, so it sees every storage
(DDP buckets and pipeline buffers included); it stays active for the warm-up steps and is re-entered
for the measured step, which resets its peak to the live bytes at that point (``__enter__``). The
peak snapshot gives bytes by reference type at the moment of the peak: Parameter (FSDP's gathered
parameters included: FSDP2 gathers a unit into the same storages every step, which MemTracker types
Parameter at the first tracked forward of the modules inside the unit), Gradient, Optstate,
Activation (forward-created tensors; FSDP's flat all-gather buffers), Temp (tensors made in backward:
activation gradients, weight gradients not yet stored), Buffer, Other. The parts are compared with
the planner's in `modelpar.measure.memory`.

Step time: wall clock of whole optimizer steps between barriers, plans interleaved round by round
(`time_cases`), so slow phases of a shared machine hit every plan alike.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.models.hf import is_hf_name
from modelpar.plan import SPLIT_BACKWARD_SCHEDULES, ParallelPlan

MEM_PARTS = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer", "Other")


@dataclass
class Case:
    """One measured run. ``plan`` as a dict (`ParallelPlan.to_dict`); batches in samples."""

    name: str
    model: str
    plan: dict
    global_batch_size: int
    local_batch_size: int
    optimizer: str = "adamw"
    steps: int = 3                 # memory: the peak of the last step (>= 3: steady state)
    seq_len: int = 0               # 0: the preset's (a Hugging Face model needs it)
    grad_clip: float = 1.0
    extra: dict = field(default_factory=dict)
    model_config: dict = field(default_factory=dict)   # --model-config of a Hugging Face model

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def planner_boundaries(model_name: str, plan: ParallelPlan,
                       model_config: dict | None = None) -> tuple[int, ...] | None:
    """The stage boundaries (`ParallelPlan.stage_boundaries`, in model-part block indices) of the
    planner's split (`modelpar.parallel.pipeline.planned_ranges`, the runtime's default too), so a
    measured pipeline splits where the prediction does even if ``parallelize``'s default changes.

    ``model_name``: a built-in preset, or a Hugging Face model (``hf:<type>`` with ``model_config``
    overrides); built on the meta device (no weight allocated).
    """
    if plan.pp <= 1:
        return None
    from modelpar.models import MLP_PRESETS, build_model
    from modelpar.parallel.parts import get_model_parts
    from modelpar.parallel.pipeline import planned_ranges
    if is_hf_name(model_name):
        from modelpar.models.hf import build_hf
        model, x = build_hf(model_name, model_config, device="meta", seed=None), None
    else:
        model = build_model(model_name, device="meta")
        x = (torch.zeros(1, MLP_PRESETS[model_name][0], device="meta") if model_name in MLP_PRESETS
             else torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device="meta"))
    rng = planned_ranges(model, get_model_parts(model), plan.num_stages, x)
    return tuple(a for a, _ in rng[1:])


def _config(case: Case):
    from modelpar.train.config import TrainConfig
    return TrainConfig(model=case.model, global_batch_size=case.global_batch_size,
                       local_batch_size=case.local_batch_size, optimizer=case.optimizer,
                       grad_clip=case.grad_clip, seq_len=case.seq_len, dropout=0.0)


def _batch(task, n: int, seed: int, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    from modelpar.models import MLP_PRESETS
    if task.kind == "lm":
        x = torch.randint(0, vocab, (n, task.tokens_per_sample), generator=g)
        return x, torch.randint(0, vocab, (n, task.tokens_per_sample), generator=g)
    w = MLP_PRESETS[task.name]
    return torch.randn(n, w[0], generator=g), torch.randint(0, w[-1], (n,), generator=g)


@dataclass
class Built:
    pm: object
    opt: torch.optim.Optimizer
    accum: int
    xg: torch.Tensor
    yg: torch.Tensor
    grad_clip: float


def build_case(case: Case, *, active: bool = True) -> Built | None:
    """Build ``case`` on this rank (collective over the world when the plan spans it). Ranks outside
    a 1-rank plan (``active=False``) build nothing and return None."""
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh, get_device
    from modelpar.plan import gradient_accumulation_steps
    from modelpar.train.loop import build_optimizer
    from modelpar.train.task import build_task, example_input

    if not active:
        return None
    plan = ParallelPlan.from_dict(case.plan)
    if plan.pp > 1 and plan.stage_boundaries is None:
        bounds = planner_boundaries(case.model, plan, case.model_config)
        plan = ParallelPlan.from_dict({**plan.to_dict(), "stage_boundaries": bounds})
    cfg = _config(case)
    task = _hf_task(case) if is_hf_name(case.model) else build_task(cfg, load_data=False)
    dev = get_device()
    mesh = build_mesh(plan, dev)
    mb = case.local_batch_size // (plan.n_microbatches if plan.pp > 1 else 1)
    pm = parallelize(task.model, plan, mesh, loss_fn=task.loss_fn, device=dev,
                     example_input=example_input(task, mb) if plan.pp > 1 else None)
    opt = build_optimizer(pm, cfg)
    accum = gradient_accumulation_steps(case.global_batch_size, case.local_batch_size, plan.dp)
    vocab = min(256, task.data_info.get("vocab", 256))
    xg, yg = _batch(task, case.global_batch_size, seed=1, vocab=vocab)
    return Built(pm, opt, accum, xg, yg, case.grad_clip)


def _hf_task(case: Case):
    """The `Task` of a Hugging Face causal LM case (``case.model_config`` overrides, dropout 0, seed 0,
    ``case.seq_len`` tokens per sample), without data."""
    from modelpar.models.hf import build_hf, facts
    from modelpar.train.task import Task, lm_loss

    if case.seq_len < 1:
        raise ValueError(f"case {case.name}: a Hugging Face model needs Case.seq_len")
    model = build_hf(case.model, case.model_config, dropout=0.0, seed=0)
    from modelpar.models.hf_unused import freeze_unreached

    freeze_unreached(model, case.model, case.model_config, case.seq_len)     # as train and the planner do
    return Task(case.model, "lm", model, None, None, lm_loss, case.seq_len, {"vocab": facts(model.hf.config).vocab})


def step(b: Built) -> None:
    from modelpar.train.step import train_step
    train_step(b.pm, b.opt, b.xg, b.yg, accum_steps=b.accum, grad_clip=b.grad_clip)


def _snap(snap: dict) -> dict[str, int]:
    out = dict.fromkeys(MEM_PARTS, 0)
    out["Total"] = 0
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            key = getattr(k, "value", k)
            out[key] = out.get(key, 0) + int(v)
    return out


def _tracker():
    """A MemTracker that accepts a root module called more than once per step (gradient
    accumulation, pipeline micro-batches): only its per-module statistics are dropped, which this
    module does not read; the device-wide snapshots and peak are unaffected. It also accepts frozen
    parameters (``requires_grad=False``), on which torch's MemTracker would register a gradient hook
    (a RuntimeError): they have no gradient to track, so they get none."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _NoHook:
        def remove(self) -> None:
            pass

    class _Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():        # marked hooked: MemTracker skips them
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return _Tracker()


def unmeasurable(case: Case) -> str | None:
    """Why `measure_memory` cannot measure ``case`` (one line naming it), or None. Zero-bubble schedules
    split each backward into an input and a weight pass (torch's ``stage_backward_input``), which
    MemTracker's module hooks break: one rank failed ("Failed to run stage backward input") and the
    other waited for its send until gloo's timeout."""
    plan = ParallelPlan.from_dict(case.plan)
    if plan.pp > 1 and plan.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        return (f"case {case.name!r}: pp_schedule {plan.pp_schedule!r} splits each backward into input and weight "
                f"passes, which MemTracker's module hooks break; `modelpar train` with this plan reports its most "
                f"loaded rank's peak (StepMemory)")
    return None


def measure_memory(case: Case, *, active: bool = True) -> dict | None:
    """Peak tensor bytes of step ``case.steps`` (steps 1 .. steps-1 warm up), by MemTracker part.

    Returns ``{"peak": {part: bytes, "Total": bytes}, "max": {part: bytes}, "fused": bool}`` where
    ``peak`` is the breakdown at the moment of the peak, ``max`` the largest value each part reached
    during the measured step and ``fused`` whether the optimizer ran torch's fused kernel (CPU only;
    None on inactive ranks).

    Raises:
        ValueError: ``case.steps < 3`` (not steady state); a case `unmeasurable` names (on every rank,
            before any collective).
    """
    if case.steps < 3:
        raise ValueError(f"Case.steps must be >= 3 for a steady-state peak, got {case.steps}")
    why = unmeasurable(case)
    if why:
        raise ValueError(why)
    from modelpar.models.hf import is_hf_name

    if is_hf_name(case.model) and case.seq_len > 0:     # its meta probe before the tracker counts it
        from modelpar.models.hf_unused import unreached_names

        unreached_names(case.model, case.model_config, case.seq_len)
    mt = _tracker()
    with mt:
        b = build_case(case, active=active)
        if b is not None:
            mt.track_external(*b.pm.modules, b.opt)
            plan = ParallelPlan.from_dict(case.plan)
            if plan.dp_shard > 1 and plan.pp == 1:
                # forget the modules a forward during the build registered (`parts.get_model_parts`
                # traces a Hugging Face model's forward to order its parts, before FSDP wraps it):
                # MemTracker types a module's parameters once, at its first tracked forward, so those
                # modules would keep the pre-FSDP tensors and FSDP's gathered parameters would stay
                # typed Activation (as they were made in forward) where the built-in GPT's are
                # Parameter. Not for pipelines: their stage modules' backward hooks need the entries
                # the build made (a KeyError in MemTracker's post-backward hook otherwise).
                mt.reset_mod_stats()
            # step 1 without the module hooks: the pipeline runtime's first step infers gradient
            # shapes with autograd.grad, which the tracker's multi-grad hooks refuse; storages are
            # still tracked (the dispatch mode stays on)
            mt._mod_tracker.__exit__()
            step(b)
            mt._mod_tracker.__enter__()
            for _ in range(case.steps - 2):
                step(b)
    if b is None:
        return None
    gc.collect()
    maxes = dict.fromkeys(MEM_PARTS, 0)
    orig = mt._update_peak_stats

    def track_max(state):          # per-part maxima alongside the total's peak
        orig(state)
        for k, v in _snap(mt._curr_mem_snap).items():
            if k in maxes:
                maxes[k] = max(maxes[k], v)
    mt._update_peak_stats = track_max
    with mt:
        step(b)
    peak = _snap(mt.get_tracker_snapshot("peak"))
    fused = bool(b.opt.defaults.get("fused"))
    del b
    gc.collect()
    return {"peak": peak, "max": maxes, "fused": fused}


def time_cases(cases: list[Case], *, rounds: int = 5, steps_per_round: int = 2, warmup: int = 3,
               settle: int = 2, active: list[bool] | None = None) -> dict[str, list[float]]:
    """Seconds per optimizer step of every case, measured in alternation: each round runs
    ``settle`` untimed and then ``steps_per_round`` timed steps of every case in turn. Cases are
    built once and kept alive, and each first runs ``warmup`` untimed steps (the steady state: on CPU,
    FSDP's and DDP's first steps run up to 1.5x slower while glibc's allocator settles).
    The settle steps drop the first steps after a switch between cases, which pay for the allocator
    state the previous case left (mlp-large FSDP2, 2 ranks: 1.43 s per step alone, 1.5-2.3 s for the
    first step after another plan's, up to 1.9 s for the second); a training run, one plan per
    process, never pays it.

    Returns ``{case name: [step seconds, ...]}`` (rank 0's clock; steps end with a barrier).
    """
    active = active or [True] * len(cases)
    built = []
    for c, a in zip(cases, active):
        b = build_case(c, active=a)
        for _ in range(warmup if b is not None else 0):
            step(b)
        built.append(b)
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    for _ in range(rounds):
        for c, b in zip(cases, built):
            for i in range(settle + steps_per_round):
                _barrier()
                t = time.perf_counter()
                if b is not None:
                    step(b)
                _barrier()
                if i >= settle:
                    times[c.name].append(time.perf_counter() - t)
    return times


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def summarize(ts: list[float]) -> dict:
    """Median, min, max and inter-quartile spread of step times (seconds)."""
    s = sorted(ts)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "q1": q[0], "q3": q[2], "n": len(s)}


def run_cases(cases: list[Case], *, mode: str = "memory", **kw) -> dict:
    """Run every case on this rank of the launch; returns rank 0's results (``{}`` elsewhere).

    A case whose plan uses fewer ranks than the world (a 1-rank plan) runs on rank 0 only. Memory
    results are gathered from every rank and the largest peak is kept (the most loaded rank).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    actives = [ParallelPlan.from_dict(c.plan).world_size == world or rank == 0 for c in cases]
    if mode == "time":
        res = time_cases(cases, active=actives, **kw)
        return {n: summarize(t) | {"times": t} for n, t in res.items()} if rank == 0 else {}
    out = {}
    for c, a in zip(cases, actives):
        try:
            r = measure_memory(c, active=a)
            err = None
        except Exception as e:  # noqa: BLE001 - reported per case; other cases go on
            r, err = None, f"rank {rank}: {type(e).__name__}: {e}"
            import traceback
            traceback.print_exc()
        per_rank = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(per_rank, {"r": r, "err": err})
        else:
            per_rank = [{"r": r, "err": err}]
        errs = [p["err"] for p in per_rank if p["err"]]
        got = [p["r"] for p in per_rank if p["r"] is not None]
        if errs:
            out[c.name] = {"error": "; ".join(errs)}
        else:
            best = max(got, key=lambda g: g["peak"]["Total"])
            out[c.name] = {**best, "per_rank_total": [g["peak"]["Total"] for g in got]}
        _barrier()
    return out if rank == 0 else {}


def worker_main(argv: list[str]) -> int:
    """``torchrun ... -m modelpar.measure.runs CASES.json OUT.json [memory|time] [rounds] [threads]``
    (everything a rank needs is in its argv and the cases file: no environment side channel)."""
    from modelpar.parallel.mesh import init_distributed

    cases_path, out_path = argv[0], argv[1]
    mode = argv[2] if len(argv) > 2 else "memory"
    torch.set_num_threads(int(argv[4]) if len(argv) > 4 else 1)
    init_distributed(timeout_s=300)
    cases = [Case(**c) for c in json.loads(open(cases_path).read())]
    kw = {"rounds": int(argv[3])} if mode == "time" and len(argv) > 3 else {}
    res = run_cases(cases, mode=mode, **kw)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def launch(cases: list[Case], world: int, *, mode: str = "memory", timeout: float = 300, rounds: int = 5,
           threads: int = 1, workdir: str | None = None) -> dict:
    """Run ``cases`` in one torchrun launch of ``world`` ranks (`modelpar.launch.run_workers`);
    returns rank 0's results.

    Raises:
        RuntimeError: the launch failed or timed out (its output tail is in the message).
        ValueError: (memory) a case `unmeasurable` names, before anything is launched.
    """
    import tempfile

    bad = [w for w in map(unmeasurable, cases) if w] if mode == "memory" else []
    if bad:
        raise ValueError("; ".join(bad))

    from modelpar.launch import run_workers

    d = workdir or tempfile.mkdtemp(prefix="modelpar-measure-")
    cp, op = os.path.join(d, "cases.json"), os.path.join(d, "out.json")
    with open(cp, "w") as f:
        json.dump([c.to_dict() for c in cases], f)
    run = run_workers(["-m", "modelpar.measure.runs", cp, op, mode, str(rounds), str(threads)], world, op,
                      timeout_s=timeout, threads=threads)
    if run.timed_out:
        raise RuntimeError(f"measure launch ({world} ranks) timed out after {timeout} s:\n{run.output[-3000:]}")
    if run.returncode != 0 or run.result is None:
        raise RuntimeError(f"measure launch ({world} ranks) failed (rc {run.returncode}):\n{run.output[-4000:]}")
    return run.result


if __name__ == "__main__":
    from modelpar.launch import exit_rank

    exit_rank(worker_main(sys.argv[1:]))
