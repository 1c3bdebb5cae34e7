"""Checks on the live model and optimizer, each one clear error raised the same on every rank.

- C2, `check_same_steps`: every rank will run the same number of optimizer steps (a rank that runs
  fewer leaves the others waiting in a collective).
- C9, `check_optimizer_params`: the optimizer holds exactly this rank's trainable parameters as they
  are after wrapping (an optimizer built before ``fully_shard`` / TP holds the replaced tensors and
  would never change the model).
- C1 / C8, `install_first_step_checks`: just before the first ``optimizer.step()``, every trainable
  parameter has a gradient (a layer that forward never calls, or a checkpointed block whose
  parameters got none; a parameter missing on only some ranks is named as rank-divergent use,
  case C12), and the optimizer check of C9 again (a forward before the optimizer was built must
  not have replaced parameters). The check of every step is `modelpar.parallel.grad_use`.

Every check gathers each rank's findings (``all_gather_object``) so that all ranks raise the same
message naming the parameters and the ranks. The findings of a good step are a few bytes per rank
(the gathered pickles are padded to the largest and every rank receives world x that); parameter names
are gathered only when some rank has something to report.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(obj) -> list:
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _raise_if_any(per_rank: list[list[str]], what: str, hint: str) -> None:
    names = sorted({n for r in per_rank for n in r})
    if names:
        ranks = [r for r, found in enumerate(per_rank) if found]
        raise ValueError(f"{len(names)} {what} (on rank(s) {ranks}): {', '.join(names[:12])}"
                         f"{' ...' if len(names) > 12 else ''}. {hint}")


def check_same_steps(num_steps: int) -> None:
    """Case C2: raise ValueError on every rank unless all ranks will run ``num_steps`` steps."""
    steps = _gather(int(num_steps))
    if len(set(steps)) > 1:
        raise ValueError(f"ranks would run different numbers of optimizer steps ({dict(enumerate(steps))}); "
                         f"the ones with fewer would leave the others waiting in a collective")


def check_optimizer_params(named_params, opt: torch.optim.Optimizer) -> None:
    """Case C9: the optimizer's parameters are exactly the trainable ``named_params`` (same objects).

    Raises:
        ValueError: naming parameters the optimizer lacks and how many it holds that the model no
            longer has (stale tensors from before wrapping), on every rank.
    """
    named = list(named_params)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    live = {id(p) for _, p in named}
    missing = [n for n, p in named if p.requires_grad and id(p) not in in_opt]
    stale = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in live)
    per_rank = _gather((missing, stale))
    miss = [m for m, _ in per_rank]
    n_stale = sum(s for _, s in per_rank)
    if any(miss) or n_stale:
        names = sorted({n for r in miss for n in r})
        raise ValueError(f"the optimizer does not hold the model's parameters as they are after wrapping: "
                         f"{len(names)} trainable parameter(s) missing from it ({', '.join(names[:8])}), "
                         f"up to {n_stale} stale tensor(s) per rank in it that the model no longer uses. Build the optimizer "
                         f"from ParallelModel.parameters() after parallelize() (case C9)")


def _raise_unused(per_rank: list[tuple[list[str], list[str]]]) -> None:
    """C1 / C12 at the first step from every rank's ``(names without a gradient, trainable names)``:
    a name missing on every rank that holds it is unused everywhere; one missing on only some of its
    holders is rank-divergent use (told apart, since the advice differs)."""
    holders: dict[str, list[int]] = {}
    for r, (_, held) in enumerate(per_rank):
        for n in held:
            holders.setdefault(n, []).append(r)
    missing = {n: [r for r, (miss, _) in enumerate(per_rank) if n in miss] for n in holders}
    some = {n: m for n, m in missing.items() if m and len(m) < len(holders[n])}
    if some:
        names = sorted(some)
        raise ValueError(f"{len(names)} trainable parameter(s) got a gradient in the first step on some ranks but "
                         f"not on others (rank-divergent use, case C12): "
                         + "; ".join(f"{n} (none on rank(s) {some[n]}, a gradient on "
                                     f"{[r for r in holders[n] if r not in some[n]]})" for n in names[:12])
                         + (" ..." if len(names) > 12 else "")
                         + ". Make every data-parallel rank use the same parameters in every step.")
    _raise_if_any([[n for n in miss if len(missing[n]) == len(holders[n])] for miss, _ in per_rank],
                  "trainable parameter(s) got no gradient in the first step",
                  "Forward uses them on no rank (unused everywhere, case C1), or an activation-checkpointed "
                  "block gave them none (case C8). Remove the unused layers or set requires_grad=False on them.")


def missing_grads(named_params) -> list[str]:
    """Names of trainable parameters whose ``.grad`` is None."""
    return [n for n, p in named_params if p.requires_grad and p.grad is None]


def install_first_step_checks(named_params, opt: torch.optim.Optimizer):
    """Check, right before the first ``opt.step()``, that every trainable parameter has a gradient
    (cases C1, C8) and that every tensor the optimizer holds got one (case C9: a stale tensor is no
    longer in the graph, so it gets none). Collective: every rank must step. Returns the hook handle
    (removed after the first step).

    Args:
        named_params: ``(name, parameter)`` pairs of this rank's modules, taken right after wrapping.

    Raises (from ``opt.step()``):
        ValueError: naming parameters without a gradient, the same on every rank.
    """
    named = list(named_params)
    handle = None

    def hook(optimizer, args, kwargs):
        handle.remove()
        stale = sum(1 for g in optimizer.param_groups for p in g["params"] if p.requires_grad and p.grad is None)
        # one gather of what is missing (empty lists in a good step); the trainable names, which
        # tell C1 from C12, only when some rank lacks a gradient (every rank sees the same answer)
        per_rank = _gather((missing_grads(named), stale))
        if any(miss for miss, _ in per_rank):
            held = _gather([n for n, p in named if p.requires_grad])
            _raise_unused([(miss, h) for (miss, _), h in zip(per_rank, held)])
        per_rank = [s for _, s in per_rank]
        if any(per_rank):
            raise ValueError(f"the optimizer holds tensors that got no gradient in the first step "
                             f"({dict(enumerate(per_rank))} per rank): stale copies of parameters that wrapping "
                             f"replaced. Build the optimizer from ParallelModel.parameters() after parallelize() "
                             f"(case C9)")

    handle = opt.register_step_pre_hook(hook)
    return handle
