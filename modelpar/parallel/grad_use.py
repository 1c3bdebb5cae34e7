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

Under DDP (torch's `DistributedDataParallel`) the steps after the first are checked locally, with no
collective: DDP reduces a bucket only once every parameter in it has a gradient on the rank, so
without ``find_unused_parameters`` every data-parallel rank must give every trainable parameter a
gradient in every step, and any rank-divergent use leaves some rank without a gradient it can see.
That rank raises before its optimizer step (naming what it lacks: it cannot tell C12 from "no rank
uses it" without a collective); a rank that has them all either raises too (its partner's buckets
did not line up) or waits in DDP's reduction of the bucket the other rank never sends, until that
rank's exit ends the launch (torchrun stops the other ranks), so no rank applies a mixed update.
With ``find_unused_parameters`` DDP reduces zeros for unused parameters, and only a changed
``requires_grad`` is left to check. The first step is checked collectively as under FSDP (one
message on every rank, C1 told from C12).

Cost (FSDP2, HSDP, ``replicate``; DDP's first step): one all-reduce (MAX) per optimizer step of ``2 x groups x ceil(2 x parameter tensors / 62)``
int64 words: each rank packs its marks (2 bits per parameter) into words and contributes them and
their negations to its group's slot, so the reduced slot holds the group's largest and (negated)
smallest words; they are equal, and equal to the pattern of a step with nothing to report, exactly
when every rank of the group sent that pattern. Only otherwise (something to name, or a pattern
already found harmless, remembered) does the all-gather of every rank's marks and the Python
diagnosis over ranks x parameters run, on every rank alike, since every rank sees the same reduced
words (`benchmarks/unused_param_check.py` measures the cost). The groups are learned once, at the first
check, from one all-gather of ``(group key, parameter count, digest of the names and trainable flags)``:
a few int64 per rank, not the names (an ``all_gather_object`` of every rank's names pads each pickle to
the largest and unpickles world x parameters strings on every rank: ~1 GB per rank at 16,384 ranks of
a 70B model). The names are gathered only when there is something to report. Turned off with
``parallelize(check_unused_params=False)`` / ``--no-check-unused-params``.
"""

from __future__ import annotations

import functools
import hashlib

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
        self._layout: list[tuple[tuple, list[str], list[bool]]] | None = None   # per rank, on a report only
        self._clean: torch.Tensor | None = None     # the gathered marks of a step with nothing to report
        self._slots: tuple[int, int, int] | None = None   # (this rank's group, groups, words per rank)
        self._harmless: set[tuple] = set()          # reduced words of steps with nothing to report
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
            ValueError: see the module docstring; the same message on every rank, except under DDP
                after the first step, where each rank that lacks a gradient names what it lacks.
        """
        step, self.step = self.step, self.step + 1
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        if self.ddp and step > 0:
            msg = self._local_ddp_diagnosis(step)
            if msg:
                raise ValueError(msg)
            return
        words = self._reduced_words()
        if words in self._harmless:
            return              # every rank of every group sent a pattern with nothing to report
        layout = self._gather_layout()      # something to name (or a pattern not yet known harmless)
        width = max(len(names) for _, names, _ in layout) or 1
        marks = torch.zeros(width, dtype=torch.uint8)
        marks[:len(self.params)] = self.local_marks()
        marks = marks.to(_comm_device())
        every = [torch.empty_like(marks) for _ in layout]
        dist.all_gather(every, marks)
        every = [m.cpu() for m in every]
        if torch.equal(torch.stack(every), self._clean_marks(layout, width)):
            return              # every trainable parameter used on every rank, none changed: no report
        msg = _diagnose(layout, [m.tolist() for m in every], step, ddp=self.ddp, find_unused=self.find_unused)
        if msg:
            raise ValueError(msg)
        if words is not None:
            self._harmless.add(words)    # e.g. a branch no rank took this step, after the first step

    def _local_ddp_diagnosis(self, step: int) -> str | None:
        """DDP after the first step: this rank's own marks (see the module docstring)."""
        changed = [(n, rg) for n, p, rg in zip(self.names, self.params, self.requires_grad) if p.requires_grad != rg]
        if changed:
            return _changed_message(changed)
        if self.find_unused:
            return None
        missing = sorted(n for n, rg, has in zip(self.names, self.requires_grad, self._seen) if rg and not has)
        if not missing:
            return None
        return (f"{len(missing)} trainable parameter(s) got no gradient on rank {dist.get_rank()} at step {step}: "
                f"{', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}. DDP reduces every parameter in "
                f"every step, so every data-parallel rank must give each trainable parameter a gradient: forward "
                f"took a branch on this rank that other ranks did not (rank-divergent use, case C12), or no rank "
                f"uses them any more. Make every rank use the same parameters in every step (run each branch "
                f"everywhere, multiplying an unneeded result by 0), set requires_grad=False on unused ones before "
                f"parallelize(), or build DDP with parallelize(..., find_unused_parameters=True), which reduces "
                f"zeros for the parameters a rank did not use (what counts is the backward of the last "
                f"accumulation micro-batch, the one that reduces). Checked on this rank alone (no collective "
                f"under DDP after the first step): other ranks may report other parameters.")

    def _learn_groups(self) -> None:
        """Once, at the first check: this rank's group slot, the number of groups and the words per
        rank from an all-gather of a few int64 per rank, and the pattern of a step with nothing to
        report (each group's trainable flags) from one all-reduce, without gathering any name. Where
        the ranks of a group disagree on their parameters (names or flags), the clean pattern comes from
        the gathered names instead, as every report does."""
        digest = hashlib.blake2b(repr((self.names, self.requires_grad)).encode(), digest_size=8).digest()
        row = torch.tensor([*self.group_key, len(self.names), int.from_bytes(digest, "little") >> 2],
                           dtype=torch.int64, device=_comm_device())
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        rows = [tuple(r.tolist()) for r in rows]
        k = len(self.group_key)
        keys = list(dict.fromkeys(r[:k] for r in rows))
        nw = -(-2 * (max(r[k] for r in rows) or 1) // _WORD_BITS)
        self._slots = (keys.index(self.group_key), len(keys), nw)
        uniform = len({r[:k] + r[k + 1:] for r in rows}) == len(keys)
        if uniform:             # every group's ranks hold the same parameters: its flags are the pattern
            self._harmless.add(self._reduce_slots(_pack([int(rg) for rg in self.requires_grad], nw)))
        else:
            clean = {key: _pack([int(rg) for rg in rgs], nw) for key, _, rgs in self._gather_layout()}
            self._harmless.add(tuple(w for key in keys for w in clean[key]))

    def _reduce_slots(self, mine: list[int]) -> tuple | None:
        """``mine`` (this rank's packed words) in its group's slot, all-reduced (MAX) over the world
        with their negations: per group, the largest and the smallest word of its ranks, as one tuple
        of the groups' words in slot order; None where they differ within a group."""
        g, n_groups, nw = self._slots
        flat = [_EMPTY] * (2 * nw * n_groups)
        flat[2 * nw * g:2 * nw * (g + 1)] = mine + [-w for w in mine]
        buf = torch.tensor(flat, dtype=torch.int64, device=_comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        out = buf.tolist()
        words = []
        for k in range(n_groups):
            hi, neg_lo = out[2 * nw * k:2 * nw * k + nw], out[2 * nw * k + nw:2 * nw * (k + 1)]
            if any(a != -b for a, b in zip(hi, neg_lo)):
                return None
            words += hi
        return tuple(words)

    def _reduced_words(self) -> tuple | None:
        """This step's marks reduced over the world in one all-reduce (MAX) (`_reduce_slots`); None
        where the ranks of a group sent different marks (the caller gathers them to name them)."""
        if self._slots is None:
            self._learn_groups()
        seen = self._seen if self._seen is not None else [p.grad is not None for p in self.params]
        return self._reduce_slots(_pack([bool(has) | ((p.requires_grad != rg) << 1)
                                         for p, rg, has in zip(self.params, self.requires_grad, seen)],
                                        self._slots[2]))

    def _clean_marks(self, layout, width: int) -> torch.Tensor:
        """(ranks, width) ``uint8``: 1 for each rank's trainable parameters, 0 elsewhere: the marks of
        a step that `_diagnose` passes without a look at the parameters (the common case, compared
        in one `torch.equal` instead of a Python loop over ranks x parameters)."""
        if self._clean is None or self._clean.shape[1] != width:
            clean = torch.zeros(len(layout), width, dtype=torch.uint8)
            for r, (_, _, rgs) in enumerate(layout):
                clean[r, :len(rgs)] = torch.tensor(rgs, dtype=torch.uint8)
            self._clean = clean
        return self._clean


_WORD_BITS = 62                  # packed bits per int64 word (non-negative, so a word and its negation fit)
_EMPTY = -(1 << 62)              # another group's slot: below every word and every negated word


def _comm_device() -> torch.device:
    """Where the default process group's collectives take tensors: the current CUDA device under
    NCCL (which refuses CPU tensors), else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(marks: list[int], nw: int) -> list[int]:
    """2-bit marks (bit 0: has a gradient, bit 1: requires_grad changed) -> ``nw`` non-negative
    int64 words of `_WORD_BITS` bits, parameter ``i`` at bits ``2i, 2i + 1`` of the whole."""
    v = 0
    for i, m in enumerate(marks):
        if m:
            v |= m << (2 * i)
    mask = (1 << _WORD_BITS) - 1
    return [(v >> (_WORD_BITS * j)) & mask for j in range(nw)]


def _changed_message(changed: list[tuple[str, bool]]) -> str:
    """The error for parameters whose ``requires_grad`` changed after DDP wrapped the model
    (``(name, was trainable)`` pairs)."""
    items = sorted((n, "trainable -> frozen" if rg else "frozen -> trainable") for n, rg in changed)
    return (f"{len(items)} parameter(s) changed requires_grad after DDP wrapped the model: "
            + ", ".join(f"{n} ({c})" for n, c in items[:12]) + (" ..." if len(items) > 12 else "")
            + ". DDP fixes which parameters it reduces when it is built, so a parameter frozen later never "
              "finishes its reduction (torch: 'Expected to have finished reduction') and one unfrozen later "
              "is never averaged. Set requires_grad before parallelize() (build a new ParallelModel and "
              "optimizer after freezing), or keep the parameters trainable and leave them out of the "
              "optimizer (or give their group lr=0)")


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
                changed[name] = rgs[i]          # trainable when wrapped
                continue
            if not rgs[i]:
                continue
            has = tuple(r for r, v in zip(ranks, m) if v & 1)
            if 0 < len(has) < len(ranks):
                divergent.setdefault((has, tuple(r for r in ranks if r not in has)), []).append(name)
            elif not has:
                unused.append((name, tuple(ranks)))
    if changed:
        return _changed_message(list(changed.items()))
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
