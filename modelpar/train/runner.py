"""`train(cfg)`: what every rank runs for `modelpar train`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from modelpar.models import PRESETS
from modelpar.parallel.compose import parallelize
from modelpar.parallel.layer_checks import dropout_note
from modelpar.parallel.mesh import build_mesh, get_device, init_distributed
from modelpar.plan_file import PlanFile
from modelpar.train.checkpoint import TrainCheckpoints
from modelpar.train.config import TrainConfig
from modelpar.train.health import guard, start_heartbeat
from modelpar.train.gather import gather_full_state_dict
from modelpar.train.loop import build_optimizer, evaluate, lr_at, preflight, reduce_losses
from modelpar.train.metrics import (PeakTensorMemory, RunRecord, StepMemory, max_over_ranks, peak_rss_bytes,
                                   per_rank)
from modelpar.train.preflight_checks import check_optimizer_params, check_same_steps, install_first_step_checks
from modelpar.train.step import train_step
from modelpar.parallel.parts import split_points_of
from modelpar.train.stop import RunStopped, StopRequest
from modelpar.train.task import build_task, example_input


def threads_per_rank(requested: int = 0) -> int:
    """``requested`` or max(1, cores // local ranks)."""
    if requested > 0:
        return requested
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def _tensors_text(peak: int) -> str:
    """The progress bar's and summary's tensor memory: unmeasured (before the tracked step, or with
    --no-track-memory on CPU) is said, not printed as 0 B."""
    return f"{_fmt_bytes(peak)} tensors" if peak else "tensors not measured"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def make_run_dir(cfg: TrainConfig, plan=None) -> Path:
    """``out_dir/<model>-<strategy>-<time>``; a run of a ``--plan`` file is named ``plan_<its strategy>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    strategy = cfg.strategy
    if cfg.plan and plan is not None:
        from modelpar.plan import strategy_of
        strategy = f"plan_{strategy_of(plan)}"
    return Path(cfg.out_dir) / f"{run_name(cfg.model)}-{strategy.replace('+', '_')}-{stamp}"


def run_name(model: str) -> str:
    """A file-name-safe short name of ``--model``: ``hf:gpt2`` -> ``hf-gpt2``, a path -> its last
    part, ``file.py:factory`` -> ``file-factory``."""
    import re

    base = model.rstrip("/")
    if ":" in base and not base.startswith("hf:"):            # module:factory / path/file.py:factory
        mod, fn = base.rsplit(":", 1)
        base = f"{Path(mod).stem}-{fn}"
    elif not base.startswith("hf:"):
        base = Path(base).stem if base.endswith(".json") else Path(base).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "model"


def train(cfg: TrainConfig, *, run_dir: Path | None = None, quiet: bool = False, resolved=None) -> dict:
    """Train per ``cfg`` on this rank; returns a summary dict (losses, timings, paths) on every rank.

    ``resolved`` (`modelpar.train.resolve.Resolved`): the plan the launcher resolved once (the run
    folder's plan.json); it is validated, not re-planned. None resolves ``cfg`` here (library use).

    Raises:
        RankFailureError: a collective failed; names the rank that died or stalled and its step.
    """
    with guard():       # a failed collective -> one error naming the rank and step (modelpar.train.health)
        return _train(cfg, run_dir=run_dir, quiet=quiet, resolved=resolved)


def _train(cfg: TrainConfig, *, run_dir: Path | None = None, quiet: bool = False, resolved=None) -> dict:
    t_start = time.time()
    rank, world = init_distributed(cfg.timeout_s)
    nthreads = threads_per_rank(cfg.threads)
    torch.set_num_threads(nthreads)
    from modelpar.models.spec import one_factory_build

    with one_factory_build():   # a factory model: the preflight's checks and the model trained are one build
        plan, batches = preflight(cfg, world, resolved)
        task = build_task(cfg)
    device = get_device() if not plan.is_placement else torch.device(plan.placement_devices[0])
    is_main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if (is_main and not quiet) else (lambda *a: None)

    if not cfg.meta_init:       # every rank keeps its own build's part: an unseeded factory is refused here
        from modelpar.verify import check_same_initial_weights
        check_same_initial_weights(task.model, cfg.model)
    if run_dir is None and is_main:
        run_dir = make_run_dir(cfg)
    record = RunRecord(run_dir if is_main else None)
    stop = None                 # the stop-signal handlers, given back on failure too (`StopRequest.close`)
    try:                        # the record's files (TensorBoard's writer thread) closed on failure too
        say(f"modelpar train: {cfg.model} on {world} rank(s), plan {plan.describe()}, "
            f"{nthreads} thread(s) per rank, device {device.type}")
        say(f"  batch: global {batches.global_batch_size}, local {batches.local_batch_size}, accumulation "
            f"{batches.accum_steps}, micro-batch {batches.micro_batch_size}")
        if task.kind == "lm":
            di = task.data_info
            say(f"  data: {di['description']}")
        nparams = sum(p.numel() for p in task.model.parameters())
        say(f"  model: {nparams / 1e6:.2f}M parameters")
        if getattr(task.model, "unreached_note", None):
            say(f"  {task.model.unreached_note}")
        record.write_json("config.json", cfg.to_dict())
        record.write_json("plan.json", PlanFile(plan, batches.global_batch_size, batches.local_batch_size,
                                                resolved.reason if resolved is not None else "").to_dict())
        record.write_json("data.json", task.data_info)

        mesh = build_mesh(plan, device)
        pm = parallelize(task.model, plan, mesh, loss_fn=task.loss_fn, device=device,
                         example_input=example_input(task, batches.micro_batch_size),
                         split_points=split_points_of(cfg.split_points), blocks=cfg.blocks or None,
                         check_unused_params=cfg.check_unused_params, sync_batchnorm=cfg.sync_batchnorm)
        if plan.pp_enabled:         # the stages hold this rank's modules; the whole model is not needed
            task.model = None       # (it would keep every other stage's parameters allocated here)
        if cfg.meta_init:           # built on meta: this rank's shards get memory and values now
            from modelpar.train.materialise import materialise

            say(f"  --meta-init: materialising each rank's shards and stages on {device.type} (rank 0: "
                f"{sum(_local_numel(p) for p in pm.parameters()) / 1e6:,.1f}M parameters)")
            materialise(pm.modules, cfg, device, ties=pm.ties)
        note = dropout_note(pm.modules, plan, cfg.dropout)
        if note:
            say(note)
        opt = build_optimizer(pm, cfg)
        ckpt = TrainCheckpoints(cfg, pm, opt, say=say,    # loads the checkpoint cfg.resume names, on any layout
                                data_info=task.data_info if task.kind == "lm" else None)
        check_same_steps(cfg.steps - ckpt.start_step)     # preflight checks: C2, C9; C1/C8 at the first step
        check_optimizer_params(pm.named_parameters(), opt)
        install_first_step_checks(list(pm.named_parameters()), opt)
        heartbeat = start_heartbeat(rank, world, timeout_s=cfg.timeout_s)

        val_before = evaluate(pm, task, batches)
        say(f"  validation loss before training: {val_before:.4f}")
        record.log(ckpt.start_step, val_loss=val_before)       # a resumed run: at the step it resumed from

        tokens_per_step = batches.global_batch_size * task.tokens_per_sample
        progress = None
        if is_main and not quiet:
            from tqdm import tqdm
            progress = tqdm(total=cfg.steps, initial=ckpt.start_step, desc="train", unit="step", dynamic_ncols=True)
        peak_tensor = 0
        losses: list[float] = []
        pending: list = []              # (loss sum, count) of the steps since the last log step
        t_train = time.time()
        # tokens/s at a log step: over the steps since the previous one (each log step reads the loss,
        # which waits for the device: between two such reads the time is the device's, not only the
        # host's time to queue the kernels), less the evaluations and checkpoint saves in between
        t_log, steps_since, paused = t_train, 0, 0.0
        val_loss = val_before
        ckpt.after_step(ckpt.start_step)                  # a checkpoint at step 0 too
        # SIGTERM / SIGUSR1 (preemption, a time limit): with checkpoints on, save and leave after the
        # step after the signal (`StopRequest`: the ranks agree one step late, without a device sync)
        stop = StopRequest(ckpt.saver is not None, device)
        for step in range(ckpt.start_step, cfg.steps):
            if heartbeat is not None:
                heartbeat.beat(step)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            # the same global batch on every rank, each reading only the rows it runs
            xg, yg = task.train.global_rows(cfg.seed, step, batches.global_batch_size)
            # the second step run (the first also builds optimizer state), or the only one
            track_at = ckpt.start_step + (1 if cfg.steps - ckpt.start_step > 1 else 0)
            track = cfg.track_memory and step == track_at and device.type == "cpu"
            # MemTracker refuses modules that run more than once per step (pipeline stages run once per
            # micro-batch, every module once per accumulated local batch): those steps are measured with
            # StepMemory instead (which does not see FSDP's storage resizes: its unsharded parameters)
            reentrant = plan.pp_enabled or batches.accum_steps > 1
            tracker = (StepMemory(pm.modules, opt) if (track and reentrant)
                       else PeakTensorMemory(device, enabled=track or device.type == "cuda"))
            # per step only what the user asked for: the loss is read (one all-reduce for the steps
            # since the last read) and the gradient norm computed (if not clipping) at log steps only
            log_now = step % max(cfg.log_every, 1) == 0 or step == cfg.steps - 1
            with tracker as mem:
                loss_sum, n, gnorm = train_step(pm, opt, xg, yg, accum_steps=batches.accum_steps,
                                                grad_clip=cfg.grad_clip, need_norm=log_now)
            if mem.peak:
                peak_tensor = max(peak_tensor, int(mem.peak))     # bytes (StepMemory sums floats)
            pending.append((loss_sum, n))
            steps_since += 1
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                t0 = time.time()
                val_loss = evaluate(pm, task, batches)
                record.log(step + 1, val_loss=val_loss)
                paused += time.time() - t0
            if log_now:
                losses.extend(reduce_losses(pm, pending))
                pending.clear()
                now = time.time()
                tok_s = tokens_per_step * steps_since / max(now - t_log - paused, 1e-9)
                t_log, steps_since, paused = now, 0, 0.0
                top_tensor, top_rss = max_over_ranks([peak_tensor, peak_rss_bytes()], device)   # the most loaded rank's
                record.log(step + 1, loss=losses[-1], grad_norm=gnorm.item(), lr=lr_at(step, cfg),
                           tokens_per_s=tok_s, peak_rss_bytes=top_rss, peak_tensor_bytes=top_tensor)
            if progress is not None:
                if log_now:
                    rate = "tok/s" if task.kind == "lm" else "samples/s"
                    progress.set_postfix_str(f"loss {losses[-1]:.3f} | val {val_loss:.3f} | {tok_s:,.0f} {rate} | "
                                             f"mem {_tensors_text(top_tensor or 0)}, "
                                             f"{_fmt_bytes(top_rss or 0)} RSS")
                progress.update(1)
            t0 = time.time()
            ckpt.after_step(step + 1)
            paused += time.time() - t0
            signum = stop.agreed()
            if signum:
                where = ckpt.save_now(step + 1)
                if progress is not None:
                    progress.close()
                record.log(step + 1, stopped_by=signal.Signals(signum).name)
                e = RunStopped(signum, step + 1, cfg.steps, where)
                say(str(e))
                raise e
        stop.close()
        ckpt.close()
        if progress is not None:
            progress.close()
        train_time = time.time() - t_train
        val_after = evaluate(pm, task, batches)
        record.log(cfg.steps, val_loss=val_after)

        state = gather_full_state_dict(pm)
        rank_peaks = per_rank(peak_tensor, device)         # each rank's own (a pipeline's ranks differ)
        peak_tensor, peak_rss = max_over_ranks([peak_tensor, peak_rss_bytes()], device)    # every rank
        summary = {"val_loss_before": val_before, "val_loss_after": val_after, "losses": losses,
                   "train_time_s": train_time, "start_step": ckpt.start_step,
                   "tokens_per_s": tokens_per_step * (cfg.steps - ckpt.start_step) / train_time,
                   "peak_tensor_bytes": peak_tensor, "peak_tensor_bytes_per_rank": rank_peaks,
                   "peak_rss_bytes": peak_rss, "plan": plan.to_dict(),
                   "run_dir": str(run_dir) if run_dir else None, "world_size": world}
        if is_main and run_dir is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(run_dir / "model.safetensors"))
            record.write_json("summary.json", {k: v for k, v in summary.items() if k != "losses"})
            byte_gpt = cfg.model in PRESETS and not (cfg.tokenizer or cfg.token_dtype)    # what sample_text decodes
            if task.kind == "lm" and cfg.sample_bytes > 0 and byte_gpt:
                summary["sample"], cut = sample_text(cfg, state, cfg.sample_bytes)
                say("\n--- sample from the trained model (prompt 'def ') ---\n" + summary["sample"] + "\n---"
                    + (f"\n{cut}" if cut else ""))
        del state
        record.close()
        per = "byte" if not (cfg.tokenizer or cfg.token_dtype) else "token"
        unit, rate = (f"nats/{per}", "tokens/s") if task.kind == "lm" else ("nats", "samples/s")
        say(f"wall time {time.time() - t_start:.1f} s (training {train_time:.1f} s) | validation loss "
            f"{val_before:.4f} -> {val_after:.4f} {unit} | {summary['tokens_per_s']:,.0f} {rate} | "
            f"peak of the most loaded rank: {_tensors_text(peak_tensor or 0)}, {_fmt_bytes(peak_rss)} RSS")
        if run_dir is not None:
            say(f"run record: {run_dir}")
        return summary
    finally:
        if stop is not None:
            stop.close()
        record.close()


def _local_numel(p) -> int:
    """Elements of this rank's part of parameter ``p`` (a DTensor's local shard)."""
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


SAMPLE_BUDGET_S = 60.0     # seconds of CPU generation the end-of-run sample may take


def sample_text(cfg: TrainConfig, state: dict[str, torch.Tensor], num_bytes: int, prompt: str = "def ",
                budget_s: float = SAMPLE_BUDGET_S) -> tuple[str, str | None]:
    """Generate up to ``num_bytes`` bytes from the trained weights ``state`` (the gathered full state
    dict on the host, as saved to model.safetensors) in a single-process model on this process's CPU,
    built on the meta device with the tensors assigned (no initialisation and no second copy of the
    weights; also under ``meta_init``, whose build keeps parameters on meta).

    Each byte costs a forward of the whole model over the context (`GPT.generate` keeps no KV cache),
    on one CPU process: seconds per byte at 1B parameters and more beyond. So generation stops at the
    first byte that ends past ``budget_s`` seconds, rather than hold the job for an hour after a
    large model's training ended.

    Returns:
        ``(text, None)``, or ``(text so far, one line saying where it stopped and why)``.
    """
    from modelpar.train.task import build_model_for

    model = build_model_for(cfg, device="meta")
    model.load_state_dict(state, assign=True)
    g = torch.Generator().manual_seed(cfg.seed)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
    t0, cut = time.perf_counter(), None
    with torch.no_grad():
        for i in range(num_bytes):              # one byte per call: the same draws as generate(num_bytes)
            idx = model.generate(idx, 1, generator=g)
            spent = time.perf_counter() - t0
            if spent > budget_s and i + 1 < num_bytes:
                cut = (f"(sample stopped at {i + 1} of {num_bytes} bytes after {spent:.0f} s of generation on this "
                       f"process's CPU; --sample-bytes 0 skips it)")
                break
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace"), cut
