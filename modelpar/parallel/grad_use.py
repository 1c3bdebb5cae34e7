"""Which parameters got a gradient in a step, agreed within each data-parallel group (cases C1, C12).

Data parallelism reduces gradients by position: DDP's buckets and FSDP2's reduce-scatter both pack
the gradients of the parameters that got one, in a fixed order, and reduce the packed buffers
across the data-parallel ranks. When the ranks of one data-parallel group use different
parameters in a step (rank-divergent control flow, case C12), the packed buffers no longer line up:
FSDP2 silently reduces one parameter's gradient into another's of the same size, and DDP leaves its
buckets unreduced and fails at the next forward with a message naming no parameter.

`GradUseCheck` runs after the backward of every optimizer step and before clipping and
``optimizer.step()``: each rank marks which of its trainable parameters have a ``.grad``, the marks
are all-gathered over the world (one ``uint8`` vector per rank, padded to the longest, so every rank
sees every group and raises the same error), and compared among the ranks of each data-parallel
group (the ranks with the same pipeline and tensor-parallel coordinates hold the same parameters).
It raises, on every rank, before any parameter changes:

- a parameter with a gradient on some ranks of its group and none on others (case C12), naming the
  parameters, the ranks that used them and the ranks that did not;
- at the first step, a trainable parameter no rank gave a gradient (case C1: forward never uses it,
  or a checkpointed block gave it none, C8);
- under DDP, a parameter used in an earlier accumulation micro-batch but not in the last one (the
  backward in which DDP reduces), on any rank, is not used (post-accumulate-grad hooks record it);
- under DDP, a change of ``requires_grad`` after wrapping (DDP fixes its buckets at construction:
  a parameter frozen later never reduces, one unfrozen later is never averaged), and from the second
  step on, a parameter no rank used (DDP would fail at the next forward).

Cost: one all-gather of ``world x (parameter tensors)`` bytes per optimizer step and a Python loop
over the parameters (`benchmarks/unused_param_check.py` measures it). Turned off with
``parallelize(check_unused_params=False)`` / ``--no-check-unused-params``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


class GradUseCheck:
    """The per-step check described in the module docstring.

    Args:
        named_params: ``(name, parameter)`` of this rank's modules, taken right after wrapping.
        group_key: this rank's coordinates outside data parallelism, ``(pp_rank, tp_rank)``; ranks with
            equal keys form one data-parallel group.
        ddp: the model is wrapped in `DistributedDataParallel` (its reducer cannot skip parameters).
        find_unused: DDP was built with ``find_unused_parameters=True`` (it then zero-fills the
            gradients of locally unused parameters; rank-divergent use is handled, not an error).
    """

    def __init__(self, named_params, group_key: tuple, *, ddp: bool = False, find_unused: bool = False):
        named = list(named_params)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.group_key = tuple(group_key)
        self.ddp, self.find_unused = ddp, find_unused
        self.step = 0
        self._layout: list[tuple[tuple, list[str], list[bool]]] | None = None   # per rank, gathered once
        # DDP reduces in the backward of the last accumulation micro-batch only: a parameter with a
        # gradient from an earlier micro-batch but none in that backward still stalls its bucket. So
        # under DDP "used" means "got a gradient since the last forward" (`reset_seen` runs as a
        # forward pre-hook of the DDP module; see `attach_reset`).
        self._seen: list[bool] | None = None
        if ddp and not find_unused:
            self._seen = [False] * len(self.params)
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(functools.partial(self._mark, i))

    def _mark(self, i: int, _p) -> None:
        self._seen[i] = True

    def reset_seen(self, *_args) -> None:
        """Forget which parameters got a gradient (DDP: called before every forward)."""
        if self._seen is not None:
            self._seen[:] = [False] * len(self._seen)

    def attach_reset(self, ddp_module) -> None:
        """Under DDP: reset the marks before each forward of ``ddp_module``."""
        if self._seen is not None:
            ddp_module.register_forward_pre_hook(self.reset_seen)

    def _gather_layout(self) -> list[tuple[tuple, list[str], list[bool]]]:
        if self._layout is None:
            mine = (self.group_key, self.names, self.requires_grad)
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, mine)
            self._layout = out
        return self._layout

    def local_marks(self) -> torch.Tensor:
        """``uint8`` per parameter: bit 0 = has a gradient, bit 1 = ``requires_grad`` changed since wrapping."""
        seen = self._seen if self._seen is not None else [p.grad is not None for p in self.params]
        return torch.tensor([bool(has) | ((p.requires_grad != rg) << 1)
                             for p, rg, has in zip(self.params, self.requires_grad, seen)], dtype=torch.uint8)

    def __call__(self) -> None:
        """Check this step's gradients (collective: every rank calls it once per optimizer step).

        Raises:
            ValueError: see the module docstring; the same message on every rank.
        """
        step, self.step = self.step, self.step + 1
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        layout = self._gather_layout()
        width = max(len(names) for _, names, _ in layout) or 1
        marks = torch.zeros(width, dtype=torch.uint8)
        marks[:len(self.params)] = self.local_marks()
        every = [torch.empty_like(marks) for _ in layout]
        dist.all_gather(every, marks)
        msg = _diagnose(layout, [m.tolist() for m in every], step, ddp=self.ddp, find_unused=self.find_unused)
        if msg:
            raise ValueError(msg)


def _diagnose(layout, marks, step: int, *, ddp: bool, find_unused: bool) -> str | None:
    """The error message for gathered marks (None when the step is fine); pure, for unit tests."""
    groups: dict[tuple, list[int]] = {}
    for r, (key, _, _) in enumerate(layout):
        groups.setdefault(key, []).append(r)
    changed, divergent, unused = {}, {}, []
    for key, ranks in groups.items():
        names, rgs = layout[ranks[0]][1], layout[ranks[0]][2]
        for i, name in enumerate(names):
            m = [marks[r][i] for r in ranks]
            if ddp and any(v & 2 for v in m):
                changed[name] = "trainable -> frozen" if rgs[i] else "frozen -> trainable"
                continue
            if not rgs[i]:
                continue
            has = tuple(r for r, v in zip(ranks, m) if v & 1)
            if 0 < len(has) < len(ranks):
                divergent.setdefault((has, tuple(r for r in ranks if r not in has)), []).append(name)
            elif not has:
                unused.append((name, tuple(ranks)))
    if changed:
        items = sorted(changed.items())
        return (f"{len(items)} parameter(s) changed requires_grad after DDP wrapped the model: "
                + ", ".join(f"{n} ({c})" for n, c in items[:12]) + (" ..." if len(items) > 12 else "")
                + ". DDP fixes which parameters it reduces when it is built, so a parameter frozen later never "
                  "finishes its reduction (torch: 'Expected to have finished reduction') and one unfrozen later "
                  "is never averaged. Set requires_grad before parallelize() (build a new ParallelModel and "
                  "optimizer after freezing), or keep the parameters trainable and leave them out of the "
                  "optimizer (or give their group lr=0)")
    if divergent:
        n = sum(len(v) for v in divergent.values())
        parts = [f"{', '.join(sorted(v)[:8])}{' ...' if len(v) > 8 else ''} (a gradient on rank(s) {list(h)}, "
                 f"none on {list(o)})" for (h, o), v in sorted(divergent.items())]
        how = ("" if not ddp else " or build DDP with parallelize(..., find_unused_parameters=True), which "
               "reduces zeros for the parameters a rank did not use")
        return (f"rank-divergent parameter use at step {step} (case C12): {n} parameter(s) got a gradient on "
                f"some data-parallel ranks and not on others: {'; '.join(parts)}. Forward takes different "
                f"branches on different ranks, so the data-parallel reduction would pair up different "
                f"parameters' gradients. Make every rank use the same parameters in every step (run each "
                f"branch everywhere, multiplying an unneeded result by 0){how}")
    if unused and (step == 0 or (ddp and not find_unused)):
        names = sorted({n for n, _ in unused})
        ranks = sorted({r for _, rs in unused for r in rs})
        what = "in the first step" if step == 0 else f"at step {step}"
        hint = ("Forward uses them on no rank (unused everywhere, case C1), or an activation-checkpointed "
                "block gave them none (case C8). Remove the unused layers or set requires_grad=False on "
                "them before parallelize()" if step == 0 else
                "DDP reduces every parameter in every step and would fail at the next forward. Set "
                "requires_grad=False on them before parallelize(), or build DDP with "
                "parallelize(..., find_unused_parameters=True)")
        if ddp and not find_unused:
            hint += (" (under DDP what counts is the backward of the last accumulation micro-batch, the one "
                     "that reduces: a gradient from an earlier micro-batch does not finish DDP's reduction)")
        return (f"{len(names)} trainable parameter(s) got no gradient {what} (on rank(s) {ranks}): "
                f"{', '.join(names[:12])}{' ...' if len(names) > 12 else ''}. {hint}.")
    return None
