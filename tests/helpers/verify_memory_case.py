"""A 2-rank scenario (``kind: "call"`` in `helpers.ckpt_worker`): `modelpar verify`'s rank code under a
pipeline, with a probe counting the parameters alive on the rank while it trains (issue 12: the
one-process reference is built again afterwards, not kept as a copy of the whole model)."""

from __future__ import annotations

import gc

import torch.nn as nn


def _live_params() -> list[nn.Parameter]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, nn.Parameter) and o.device.type != "meta"]


def verify_pp(spec: dict) -> dict:
    """``modelpar verify`` of spec["argv"] on this rank (its `run_rank`); returns the exit code, the
    elements of the rank's own parameters and of every other parameter alive while it trains (made
    during the scenario), and the model's total elements."""
    from modelpar.cli.args import normalize_argv
    from modelpar.cli.verify import build_parser, given_fields, load_task, parse, resolve_plan, run_rank

    before = _live_params()              # held: what lived before the scenario is not counted
    known = {id(p) for p in before}
    p = build_parser()
    argv = normalize_argv(list(spec["argv"]), p, prog="modelpar verify")
    args = parse(p, argv)
    plan, local = resolve_plan(args, given_fields(p, argv))
    local = local or args.global_batch_size // plan.dp
    whole = sum(q.numel() for q in load_task(args)[0].parameters())
    seen: dict = {}

    def probe(pm):
        own = {id(q) for q in pm.parameters()}
        other = [q for q in _live_params() if id(q) not in known and id(q) not in own]
        seen.update(own=sum(q.numel() for q in pm.parameters()), other=sum(q.numel() for q in other),
                    other_shapes=sorted({tuple(q.shape) for q in other})[:5])

    code = run_rank(args, plan, local, probe=probe)
    del before
    import torch.distributed as dist

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, seen)
    return {"code": code, "whole": whole, "ranks": ranks}
