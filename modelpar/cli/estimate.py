"""``modelpar estimate``: does the model fit on N devices, and how -- or, for one exact layout
(``--plan FILE``, a ``--strategy`` shorthand or degrees), its predicted step time, MFU / HFU,
tokens/s per device and peak memory per rank by part.

Predictions come from the planner's `estimate_step` / `estimate_memory` (`modelpar.planner`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.common import GIB, PlannerOptions, precision_for, profile_for
from modelpar.cli.options import BATCH_TERMS, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions, PartsOptions, world_size

EXAMPLES = """examples:
  modelpar estimate --model gpt-70b --nproc 64 --hardware H200                  # does it fit, and how?
  modelpar estimate --model gpt-1b --nproc 8 --hardware H100-80GB-SXM --strategy fsdp --micro-batch-size 4
  modelpar estimate --model gpt-1b --model-config '{"n_layer": 24}' --nnodes 2 --gpus-per-node 8 \\
      --hardware H100-80GB-SXM --dp-shard 8 --tp 2 --global-batch-size 512 --micro-batch-size 8 --json
  modelpar estimate --plan runs/<run>/plan.json --model gpt-3m                  # a run folder's layout
  modelpar estimate --model hf:gpt2 --model-config '{"n_layer": 24, "n_embd": 1024, "n_head": 16}' \\
      --seq-len 1024 --nproc 8 --hardware H100-80GB-SXM --strategy fsdp
"""


@dataclass
class LayoutDegrees:
    """An exact layout by degrees (instead of --plan or a --strategy shorthand).

    Args:
        dp_replicate: data-parallel (replicated) degree (0: from --strategy).
        dp_shard: FSDP degree (0: from --strategy).
        tp: tensor-parallel degree (0: from --strategy).
        pp: pipeline-parallel degree (0: from --strategy).
        micro_batch_size: samples per forward/backward on one data-parallel rank, or per pipeline
            micro-batch under PP (0: 1, or the plan file's).
    """

    dp_replicate: int = 0
    dp_shard: int = 0
    tp: int = 0
    pp: int = 0
    micro_batch_size: int = 0


def build_parser():
    from modelpar.plan import ParallelPlan

    p = make_parser("modelpar estimate", (
        "Without a layout: the memory per device of each basic strategy and the planner's best plan. With "
        "--plan FILE, a --strategy shorthand or degrees: that exact layout's predicted step time, MFU and HFU, "
        "tokens/s per device and peak memory per rank by part, and whether it fits."),
        epilog=EXAMPLES + "\n" + BATCH_TERMS)
    add_fields(p, ModelOptions)
    add_fields(p, PartsOptions, only=("blocks",))
    add_fields(p, LayoutOptions)
    add_fields(p, BatchOptions)
    add_fields(p, HardwareOptions)
    add_fields(p, PlannerOptions)
    add_fields(p, LayoutDegrees)
    skip = {"dp_replicate", "dp_shard", "tp", "pp", "precision", "placement_devices"}
    add_fields(p, ParallelPlan, skip=skip, dest_prefix="plan_options.", group="plan options (exact layout)")
    return p


def _exact_plan(a, given: set[str], n: int, prec: str):
    """``(PlanFile, source)`` of the exact layout asked for, or None (no layout given)."""
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile, read_plan_file
    from modelpar.train.resolve import _check_degrees_fit

    degrees = {k: getattr(a, k) for k in ("dp_replicate", "dp_shard", "tp", "pp") if getattr(a, k)}
    opts = {k.split(".", 1)[1]: getattr(a.plan_options, k.split(".", 1)[1]) for k in given
            if k.startswith("plan_options.")}
    if a.plan:
        if degrees or "strategy" in given:
            raise ValueError("give --plan or --strategy / degrees, not both")
        pf = read_plan_file(a.plan)
        if opts:
            pf = dataclasses.replace(pf, plan=dataclasses.replace(pf.plan, **opts))
        return pf
    s = a.strategy.lower()
    if not degrees and s in ("auto", "rules"):
        return None
    if s in ("auto", "rules"):
        if "strategy" in given:
            raise ValueError(f"--strategy {s} chooses the degrees itself; drop the degrees, or use "
                             f"--strategy custom to estimate exactly them")
        s = "custom"
    if s == "custom":
        plan = ParallelPlan(**degrees, precision=prec, **opts)
    else:
        from modelpar.plan import plan_for_strategy
        _check_degrees_fit(s, n, degrees)
        plan = plan_for_strategy(s, n, **degrees, precision=prec, **opts)
    if plan.pp > 1 and "plan_options.n_microbatches" not in given:
        plan = dataclasses.replace(plan, n_microbatches=2 * plan.pp)
    return PlanFile(plan)


def main(argv: list[str]) -> int:
    from modelpar.cli.options import resolve_hardware

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar estimate")
    a = parse(p, argv)
    given = given_fields(p, argv)
    n = world_size(a, given)
    from modelpar.models.spec import check_model
    check_model(a.model, a.model_config)          # bad names fail first, before any note
    hw = resolve_hardware(a.hardware, n, gpus_per_node=a.gpus_per_node)
    prec = precision_for(a.precision, hw)
    pf = _exact_plan(a, given, n, prec)
    if pf is not None and "nproc" not in given and "nnodes" not in given:
        n = pf.plan.world_size                     # a plan file brings its own world size
    prof, desc = profile_for(a.model, a.model_config, a.seq_len, pf.plan.precision if pf else prec, a.blocks)
    if pf is None:
        if a.json:
            raise ValueError("--json describes one exact layout: give --plan FILE, a --strategy or degrees")
        return _fit_answer(a, given, prof, desc, n, hw, prec)
    return _exact_answer(a, given, pf, prof, desc, n, hw)


def _exact_answer(a, given, pf, prof, desc, n: int, hw) -> int:
    from modelpar.plan_file import PlanFile
    from modelpar.planner.cost import estimate_step, hfu, mfu
    from modelpar.planner.memory import Batch, estimate_memory

    plan = pf.plan.validate(n, num_blocks=None)
    from modelpar.planner.legality import check_tp_degree, split_violations
    check_tp_degree(prof.arch, plan.tp)           # heads / key-value heads / widths / vocabulary
    bad = split_violations(prof.tp_splits, plan.tp)   # any model's TP plan (case C7)
    if bad:
        raise ValueError(f"tensor parallel degree tp={plan.tp} does not divide {', '.join(bad)} (split by "
                         f"the model's TP plan); choose a TP degree that divides every split dimension")
    m = plan.n_microbatches if plan.pp > 1 else 1
    if a.micro_batch_size:
        local = a.micro_batch_size * m
        if pf.local_batch_size is not None and pf.local_batch_size != local:
            raise ValueError(f"--micro-batch-size {a.micro_batch_size} contradicts the plan file's local batch "
                             f"{pf.local_batch_size} ({m} micro-batch(es)); drop one")
    else:
        local = pf.local_batch_size or m
    gbs = a.global_batch_size
    if pf.global_batch_size is not None and "global_batch_size" not in given:
        gbs = pf.global_batch_size
    batch = Batch(gbs, local)
    batch.accumulation_steps(plan)                # raises naming the numbers
    mem = estimate_memory(prof, plan, batch, optimizer=a.optimizer, overhead_bytes=hw.framework_overhead_bytes)
    st = estimate_step(prof, plan, batch, hw, optimizer=a.optimizer)
    fits = mem.total <= hw.memory_bytes
    tok = st.tokens_per_s / n if st.tokens_per_sample > 1 else None
    out = PlanFile(plan, gbs, local, f"modelpar estimate --model {a.model} on {n} x {hw.name}").to_dict()
    if a.json:
        out["predicted"] = {"step_s": st.total, "mfu": mfu(st, hw, plan.precision), "hfu": hfu(st, hw, plan.precision),
                            "tokens_per_s_per_device": tok, "samples_per_s": st.samples_per_s,
                            "memory_bytes": {**mem.parts(), "total": mem.total}, "memory_limit_bytes": hw.memory_bytes,
                            "fits": fits, "pp_rank": mem.pp_rank, "step_parts_s": st.parts()}
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0 if fits else 1
    print(f"{desc}: {prof.num_params / 1e6:,.1f}M params; {plan.describe()} on {n} x {hw.name} "
          f"({hw.memory_bytes / GIB:.1f} GiB each); global batch {gbs}, local {local}, micro-batch {local // m}, "
          f"accumulation {batch.accumulation_steps(plan)}")
    rate = f"{tok:,.0f} tokens/s per device" if tok is not None else f"{st.samples_per_s / n:,.1f} samples/s per device"
    print(f"  step {st.total * 1e3:,.1f} ms | MFU {mfu(st, hw, plan.precision):.1%} | HFU "
          f"{hfu(st, hw, plan.precision):.1%} | {rate}")
    print("  step time by part: " + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in st.parts().items() if v))
    print(f"  peak memory per rank (pipeline rank {mem.pp_rank}, at {mem.phase}):")
    for k, v in mem.parts().items():
        print(f"    {k:<14} {v / GIB:10.3f} GiB")
    print(f"    {'total':<14} {mem.total / GIB:10.3f} GiB of {hw.memory_bytes / GIB:.1f}: "
          f"{'fits' if fits else 'does NOT fit'}")
    return 0 if fits else 1


def _fit_answer(a, given, prof, desc, n: int, hw, prec: str) -> int:
    from modelpar.plan import plan_for_strategy
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.search import search_plans

    print(f"{desc}: {prof.num_params / 1e6:,.1f}M params; {n} x {hw.name} "
          f"({hw.memory_bytes / GIB:.1f} GiB each), {prec}, micro-batch 1")
    for s in (("single",) if n == 1 else ("ddp", "fsdp", "tp", "pp")):
        try:
            plan = plan_for_strategy(s, n, precision=prec)
            local = plan.n_microbatches if plan.pp > 1 else 1
            m = estimate_memory(prof, plan, Batch(local * plan.dp, local), optimizer=a.optimizer,
                                overhead_bytes=hw.framework_overhead_bytes)
            fits = "fits" if m.total <= hw.memory_bytes else "does NOT fit"
            print(f"  {s:<6} {m.total / GIB:10.2f} GiB/device  {fits}")
        except ValueError as e:
            print(f"  {s:<6} not applicable: {e}")
    from modelpar.cli.plan import search_kwargs
    ac = a.plan_options.activation_checkpointing if "plan_options.activation_checkpointing" in given else ""
    every = a.plan_options.ac_every if "plan_options.ac_every" in given else 0
    rep = search_plans(prof, n, hw, global_batch_size=a.global_batch_size, optimizer=a.optimizer, precision=prec,
                       **search_kwargs(ac, every))
    if not rep.ranked:
        print(f"no: nothing fits on {n} devices ({rep.summary()})")
        return 1
    c = rep.ranked[0]
    print(f"yes: best plan {c.plan.describe()} (micro-batch {c.micro_batch_size}), "
          f"{c.memory.total / GIB:.2f} GiB/device, {c.step.total * 1e3:.1f} ms/step")
    return 0
