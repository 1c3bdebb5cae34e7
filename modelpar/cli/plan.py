"""``modelpar plan``: rank every parallel layout of a model on N devices by predicted throughput.

``--strategy S`` ranks only the plans of one family (`modelpar.plan.strategy_of`; ``rules``: the
rule-of-thumb plan, priced); ``--plan FILE`` prices exactly one plan, given in the plan-file format
that ``plan --explain K --json`` writes (`modelpar.plan_file`), with the same numbers the ranking
would give it (the planner's `estimate_memory` / `estimate_step` with the search's settings).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.common import GIB, PlannerOptions, params_phrase, precision_for, profile_for
from modelpar.cli.options import (BATCH_TERMS, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions, PartsOptions,
                                  add_plan_fields, global_batch_size_given, plan_fields_given, world_size)

EXAMPLES = """examples:
  modelpar plan --model gpt-1b --nproc 8 --hardware H100-80GB-SXM
  modelpar plan --model gpt-70b --nnodes 8 --gpus-per-node 8 --hardware H100-80GB-SXM --top 5
  modelpar plan --model gpt-1m --explain 1 --json > plan.json      # then: modelpar train --plan plan.json
  modelpar plan --model gpt-1m --plan plan.json                    # price exactly that plan
  modelpar plan --model gpt-1b --nproc 8 --hardware H100-80GB-SXM --strategy fsdp+tp   # one family only
  modelpar plan --model hf:llama --model-config '{"hidden_size": 4096, "intermediate_size": 14336, \\
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, \\
      "max_position_embeddings": 8192}' --seq-len 8192 --nproc 64 --hardware H100-80GB-SXM   # Llama 3 8B
  modelpar plan --model path/to/config.json --seq-len 2048 --nproc 8 --hardware H100-80GB-SXM
"""


@dataclass
class PlanCommand:
    """What to print.

    Args:
        top: how many plans to print.
        explain: print the memory and step-time breakdown of plan K (1-based; 0: none).
    """

    top: int = 10
    explain: int = 0


def build_parser():
    p = make_parser("modelpar plan", (
        "Predict memory per device and step time of every parallel layout (dp_replicate x dp_shard x tp x pp, "
        "schedules, micro-batches, checkpointing) and print the fastest that fit."),
        epilog=EXAMPLES + "\n" + BATCH_TERMS)
    add_fields(p, ModelOptions)
    add_fields(p, PartsOptions, only=("blocks",))
    add_fields(p, LayoutOptions)
    add_fields(p, BatchOptions)
    add_fields(p, HardwareOptions)
    add_fields(p, PlannerOptions)
    add_plan_fields(p, only=SEARCH_FIELDS)        # train's flags for the fields that narrow the search
    add_fields(p, PlanCommand)
    return p


# the `ParallelPlan` fields `plan` takes (it ranks layouts: exact degrees go to --plan or `estimate`)
SEARCH_FIELDS = ("precision", "activation_checkpointing", "ac_every")


def _row(i, c, hw, prec) -> str:
    from modelpar.planner.cost import mfu
    st = c.step
    rate = f"{st.tokens_per_s:,.0f} tok/s" if st.tokens_per_sample > 1 else f"{st.samples_per_s:,.1f} smp/s"
    return (f"{i:>3} {c.plan.describe():<58} {c.micro_batch_size:>4} {c.memory.total / GIB:>8.2f} "
            f"{st.total * 1e3:>10.1f} {rate:>18} {mfu(st, hw, prec):>6.1%} {st.comm_share:>6.1%} "
            f"{st.bubble_share:>6.1%}")


def main(argv: list[str]) -> int:
    from modelpar.cli.options import resolve_hardware
    from modelpar.planner.search import search_plans
    from modelpar.train.resolve import search_settings

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar plan")
    a = parse(p, argv)
    given = given_fields(p, argv)
    n = world_size(a, given)
    if a.json and not a.explain and not a.plan:
        raise ValueError("--json prints one plan file: give --explain K too")
    strategy = a.strategy.lower()
    pf = _plan_file(a, given) if a.plan else None
    if pf is not None and "nproc" not in given and "nnodes" not in given:
        n = pf.plan.world_size                    # a plan file brings its own world size
    _check_strategy(strategy, n)
    from modelpar.models.spec import check_model
    check_model(a.model, a.model_config)          # bad names fail first, before any note
    hw = resolve_hardware(a.hardware, n, gpus_per_node=a.gpus_per_node)
    fields = plan_fields_given(a)
    prec = pf.plan.precision if pf is not None else precision_for(fields.get("precision"), hw)
    prof, desc = profile_for(a.model, a.model_config, a.seq_len, prec, a.blocks)
    t = time.perf_counter()
    if pf is not None or strategy == "rules":
        c, what = _priced(a, given, pf, prof, n, hw, prec)
        return _print_one(a, c, what, desc, prof, n, hw, prec, time.perf_counter() - t)
    # only the plans printed (and the one explained) are needed: the exact top-k mode ranks just those
    # (the summary then says how many were evaluated and found feasible, a lower bound on the total);
    # one strategy family: only its layouts are searched (the full ranking's plans of that family, in order)
    family = strategy != "auto"
    settings = dict(global_batch_size=a.global_batch_size, optimizer=a.optimizer, precision=prec,
                    **search_settings(fields))           # as train --strategy auto's search
    rep = search_plans(prof, n, hw, top_k=max(a.top, a.explain, 1), strategy=strategy if family else None,
                       **settings)
    ranked = rep.ranked
    if family and not ranked:
        if prof.pipeline_refusal and strategy.startswith("pp"):
            raise ValueError(f"--strategy {strategy}: {prof.pipeline_refusal}")     # as train refuses it
        if prof.tp_refusal and "tp" in strategy:
            raise ValueError(f"--strategy {strategy}: {prof.tp_refusal}")           # as train refuses it
        best = search_plans(prof, n, hw, top_k=1, **settings).ranked
        if best:
            print(f"no {strategy} plan is feasible for {desc} on {n} x {hw.name} ({rep.summary()}); the best "
                  f"plan of any strategy is {best[0].plan.describe()} ({best[0].step.total * 1e3:.1f} ms/step)")
            return 1
    if a.explain and not 1 <= a.explain <= len(ranked):
        raise ValueError(f"--explain {a.explain}: only {len(ranked)} plans are feasible")
    if a.json:
        c = ranked[a.explain - 1]
        what = f"plan {a.explain} of >= {rep.topk_stats['fitting']} feasible" + (f" {strategy} plans" if family else "")
        print(_plan_json(a, c, f"{what} on {n} x {hw.name}"))
        return 0
    only = f" (strategy {strategy} only)" if family else ""
    print(f"{desc} ({params_phrase(prof)}) on {n} x {hw.name}, "
          f"global batch {a.global_batch_size}, {prec}: {rep.summary()}{only} [{time.perf_counter() - t:.2f} s]")
    if not ranked:
        print("no plan fits; reasons above")
        return 1
    _print_table(ranked[:a.top], hw, prec)
    if a.explain:
        _print_explain(a.explain, ranked[a.explain - 1], hw)
    return 0


def _check_strategy(strategy: str, n: int) -> None:
    """``--strategy`` names a family the planner ranks on ``n`` devices.

    Raises:
        ValueError: an unknown name (the valid ones listed), ``custom`` or ``placement`` (why they are
            not ranked, and what to run instead), or a family that cannot use ``n`` devices.
    """
    from modelpar.plan import plan_for_strategy

    if strategy in ("auto", "rules"):
        return
    if strategy == "custom":
        raise ValueError("--strategy custom runs exactly the degrees you give, so there is nothing to rank: "
                         "price that layout with --plan '{\"dp_shard\": 2, \"tp\": 2}' (or modelpar estimate "
                         "--dp-shard 2 --tp 2), or drop --strategy to rank every layout")
    if strategy == "placement":
        raise ValueError("--strategy placement (one process over a list of devices) is not modelled by the "
                         "planner, so it is not ranked; drop --strategy to rank the multi-rank layouts")
    plan_for_strategy(strategy, n)                # unknown names; single on n > 1; hybrids on odd n


def _plan_file(a, given: set[str]):
    """The `PlanFile` of ``--plan`` (the format ``plan --explain K --json`` writes).

    Raises:
        ValueError: --plan with --strategy, a plan flag that contradicts the file (as `train --plan`:
            `modelpar.train.resolve.check_agrees_with_plan_file`), or what `read_plan_file` raises.
    """
    from modelpar.plan_file import read_plan_file
    from modelpar.train.resolve import check_agrees_with_plan_file

    if "strategy" in given:
        raise ValueError(f"give --plan or --strategy, not both (--plan {a.plan!r}, --strategy {a.strategy})")
    pf = read_plan_file(a.plan)
    check_agrees_with_plan_file(pf, plan_fields_given(a), a.plan)
    return pf


def _priced(a, given: set[str], pf, prof, n: int, hw, prec: str):
    """``(Candidate, description)`` of exactly one plan: ``--plan``'s, or the rules baseline's
    (``--strategy rules``), with the numbers `search_plans` would give it (same memory and step
    models, same settings: foreach optimizers on accelerators, gloo's copies on CPU).

    Raises:
        ValueError: a plan that does not use ``n`` devices or this model's blocks / heads, a batch the
            plan cannot split, or a --global-batch-size that contradicts the plan file's.
    """
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.legality import check_model_takes
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.search import Candidate

    gbs, local = global_batch_size_given(a, given), None        # a --plan file's, unless given
    if pf is None:
        from modelpar.planner.rules import rule_plan
        from modelpar.train.resolve import with_checkpointing_given
        plan, why = rule_plan(prof, n, hw, global_batch_size=gbs, optimizer=a.optimizer, precision=prec,
                              task="language" if prof.arch else "image")
        plan = with_checkpointing_given(plan, plan_fields_given(a))   # as train --strategy rules
        what = f"rules: {why}"
    else:
        plan, local, what = pf.plan, pf.local_batch_size, f"plan file {a.plan}"
        if pf.global_batch_size is not None and gbs != pf.global_batch_size:
            raise ValueError(f"--plan {a.plan!r} was made for global_batch_size={pf.global_batch_size}, but "
                             f"--global-batch-size is {gbs}; drop one")
    blocks = len(prof.blocks) - 2 if prof.arch and len(prof.blocks) >= 3 else len(prof.blocks)
    plan.validate(n, num_blocks=blocks)
    check_model_takes(prof, plan)                 # what train would refuse before launch
    batch = Batch(gbs, local or gbs // plan.dp)   # no local batch given: what train runs (global / dp)
    batch.accumulation_steps(plan)                # raises naming the numbers
    plan.validate(n, num_blocks=blocks, local_batch_size=batch.local_batch_size)
    mem = estimate_memory(prof, plan, batch, optimizer=a.optimizer, overhead_bytes=hw.framework_overhead_bytes,
                          foreach=hw.kind != "cpu", gloo=hw.kind == "cpu")
    st = estimate_step(prof, plan, batch, hw, optimizer=a.optimizer)
    return Candidate(plan, batch, mem, st), what


def _print_one(a, c, what: str, desc: str, prof, n: int, hw, prec: str, seconds: float) -> int:
    """One priced plan: its table row and breakdown (or, with --json, its plan file). Exit code 1
    when it does not fit in the device's memory."""
    fits = c.memory.total <= hw.memory_bytes
    if a.json:
        print(_plan_json(a, c, f"{what}, priced on {n} x {hw.name}"))
        return 0 if fits else 1
    print(f"{desc} ({params_phrase(prof)}) on {n} x {hw.name}, global batch "
          f"{c.batch.global_batch_size}, {prec}: one plan priced ({what}) [{seconds:.2f} s]")
    _print_table([c], hw, prec)
    _print_explain(1, c, hw)
    if not fits:
        print(f"  does NOT fit: {c.memory.total / GIB:.2f} GiB per device > {hw.memory_bytes / GIB:.1f}")
    return 0 if fits else 1


def _plan_json(a, c, what: str) -> str:
    from modelpar.plan_file import PlanFile

    pf = PlanFile(c.plan, c.batch.global_batch_size, c.batch.local_batch_size, f"modelpar plan --model {a.model}: {what}")
    return json.dumps(pf.to_dict(), indent=1, sort_keys=True)


def _print_table(cands, hw, prec: str) -> None:
    print(f"{'#':>3} {'plan':<58} {'mb':>4} {'GiB/dev':>8} {'step ms':>10} {'throughput':>18} "
          f"{'MFU':>6} {'comm':>6} {'bubble':>6}")
    for i, c in enumerate(cands, 1):
        print(_row(i, c, hw, prec))


def _print_explain(k: int, c, hw) -> None:
    print(f"\nplan {k}: {c.plan.describe()}  local batch {c.batch.local_batch_size}, "
          f"micro-batch {c.micro_batch_size}\n  {c.plan.to_json()}")
    print(f"  memory per device (pipeline rank {c.memory.pp_rank}, peak at {c.memory.phase}):")
    for k_, v in c.memory.parts().items():
        print(f"    {k_:<14} {v / GIB:10.3f} GiB")
    print(f"    {'total':<14} {c.memory.total / GIB:10.3f} GiB of {hw.memory_bytes / GIB:.1f}")
    print("  step time:")
    for k_, v in c.step.parts().items():
        print(f"    {k_:<14} {v * 1e3:10.2f} ms {v / c.step.total:6.1%}")
    print(f"    {'total':<14} {c.step.total * 1e3:10.2f} ms")
