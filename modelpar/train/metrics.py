"""Run records: per-step metrics as JSONL, TensorBoard scalars where installed, memory readings."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_over_ranks(values: list[int], device) -> list[int]:
    """Collective (every rank, the same call): the largest of each of ``values`` (bytes) over the ranks
    of the default process group, so what a run reports is its most loaded rank's (a pipeline's last
    stage holds the logits; rank 0, which logs, the first stage); ``values`` as they are on one process.
    ``None`` entries (not measured) count as 0 and come back None where every rank had none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor([float(v or 0) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) or None for x in t.tolist()]


def per_rank(value: int | None, device) -> list[int | None]:
    """Collective (every rank, the same call): ``value`` (bytes; None: not measured) of every rank of
    the default process group, in rank order (one all-gather), so a run record can name each pipeline
    rank's peak beside the most loaded one's (`max_over_ranks`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    t = torch.tensor([float(value or 0)], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x.item()) or None for x in out]


class PeakTensorMemory:
    """Peak bytes of live tensors during a region.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: torch's MemTracker (a private API,
    ``torch.distributed._tools.mem_tracker``; its use is pinned by a test), which counts every tensor
    storage allocated through the dispatcher, parameters, gradients, optimizer state and activations.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled, self.peak, self._mt = device, enabled, 0, None

    def __enter__(self):
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mt = _frozen_safe_tracker()
            self._mt.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mt.__exit__(*exc)
            peaks = self._mt.get_tracker_snapshot("peak")
            self.peak = sum(v.get("Total", 0) for v in peaks.values()) if peaks else 0
        return False


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_safe_tracker():
    """torch's MemTracker, minus its gradient hooks on parameters that take no gradient: it registers one
    on every parameter of each module it enters, and a frozen one (``requires_grad=False``: a LoRA-style
    model's base weights) raised 'cannot register a hook on a tensor that doesn't require gradient' in
    the first step of every `modelpar train` on the CPU (``--track-memory``, the default). The frozen
    parameters' bytes are still counted (they are parameters, not gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenSafeMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for q in module.parameters():
                if not q.requires_grad and self._param_to_grad_hook_handles.get(q, None) is None:
                    self._param_to_grad_hook_handles[q] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenSafeMemTracker()


class RunRecord:
    """Writes metrics.jsonl (and TensorBoard scalars) in ``run_dir``; a no-op on non-zero ranks."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self._f = None
        self._tb = None
        if run_dir is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._f = open(run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:
            self._tb = None

    def write_json(self, name: str, obj) -> None:
        if self.run_dir is not None:
            (self.run_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")

    def log(self, step: int, **metrics) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Close the files (idempotent: also called when a run fails)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _storage_bytes(tensors) -> float:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen, total = set(), 0.0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class StepMemory:
    """Peak bytes of live tensors during a region, for steps torch's MemTracker cannot follow (a
    pipeline runs each stage module once per micro-batch, which MemTracker refuses).

    A TorchDispatchMode counts the storages created inside the region until they are freed; parameters,
    buffers and optimizer state present at entry are counted as static. Parts at the peak: parameters
    and optimizer state as held, gradients at full size (their final size), activations = the rest.
    Storage resizes (FSDP's unsharded parameters) are not seen: use MemTracker for FSDP.
    """

    def __init__(self, modules, optimizer):
        self.modules, self.opt = modules, optimizer
        self.peak = 0.0

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        params = [p for m in self.modules for p in m.parameters()]
        bufs = [b for m in self.modules for b in m.buffers()]
        opt_state = [v for st in self.opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
        self.static = _storage_bytes(params + bufs + opt_state)
        known = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in params + bufs + opt_state}
        live: dict[int, float] = {}
        state = {"cur": self.static, "peak": self.static}
        self._state, self._refs = state, []
        outer = self

        def freed(ptr):
            state["cur"] -= live.pop(ptr, 0.0)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if hasattr(t, "untyped_storage") and t.device.type != "meta":
                        st = t.untyped_storage()
                        try:
                            ptr = st.data_ptr()
                        except RuntimeError:    # a storage FSDP2 has already freed/resized: not live
                            continue
                        if ptr and ptr not in live and ptr not in known:
                            live[ptr] = float(st.nbytes())
                            state["cur"] += live[ptr]
                            outer._refs.append(weakref.finalize(st, freed, ptr))
                state["peak"] = max(state["peak"], state["cur"])
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self.peak = self._state["peak"]
        return False

    def parts(self) -> dict[str, float]:
        params = _storage_bytes([p for m in self.modules for p in m.parameters()] +
                                [b for m in self.modules for b in m.buffers()])
        opt = _storage_bytes([v for st in self.opt.state.values() for v in st.values()
                              if hasattr(v, "untyped_storage")])
        grads = params - _storage_bytes([b for m in self.modules for b in m.buffers()])
        return {"params": params, "grads": grads, "optimizer": opt,
                "activations": max(0.0, self.peak - params - opt - grads), "total": self.peak}
