"""``modelpar estimate``: does the model fit on N devices, and how -- or, for one exact layout
(``--plan FILE``, a ``--strategy`` shorthand or degrees), its predicted step time, MFU / HFU,
tokens/s per device and peak memory per rank by part.

The layout flags are train's (`modelpar.cli.options.add_plan_fields`) and resolved by train's one
resolution (`modelpar.train.resolve.resolve`), so ``estimate`` prices the plan ``train`` with the same
flags would run. Predictions come from the planner's `estimate_step` / `estimate_memory`
(`modelpar.planner`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.common import GIB, PlannerOptions, params_phrase, precision_for, profile_for
from modelpar.cli.options import (BATCH_TERMS, DEGREES, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions,
                                  PartsOptions, add_plan_fields, global_batch_size_given, plan_fields_given,
                                  run_world_size, strategy_given)

EXAMPLES = """examples:
  modelpar estimate --model gpt-70b --nproc 64 --hardware H200                  # does it fit, and how?
  modelpar estimate --model gpt-1b --nproc 8 --hardware H100-80GB-SXM --strategy fsdp --micro-batch-size 4 \\
      --global-batch-size 32
  modelpar estimate --model gpt-1b --model-config '{"n_layer": 24}' --nnodes 2 --gpus-per-node 8 \\
      --hardware H100-80GB-SXM --dp-shard 8 --tp 2 --global-batch-size 512 --micro-batch-size 8 --json
  modelpar estimate --plan runs/<run>/plan.json --model gpt-3m                  # a run folder's layout
  modelpar estimate --model hf:gpt2 --model-config '{"n_layer": 24, "n_embd": 1024, "n_head": 16}' \\
      --seq-len 1024 --nproc 8 --hardware H100-80GB-SXM --strategy fsdp
"""


@dataclass
class EstimateOptions:
    """The exact layout's batch (estimate's own; the plan flags are train's, `add_plan_fields`).

    Args:
        micro_batch_size: samples per forward/backward on one data-parallel rank, or per pipeline
            micro-batch under PP (0: the plan file's, else what train runs with the same flags: the
            global batch / dp samples per rank, no accumulation, in the plan's micro-batches).
    """

    micro_batch_size: int = 0


def build_parser():
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
    add_fields(p, EstimateOptions)
    add_plan_fields(p)                            # the same plan flags as train / verify
    return p


def exact_layout(a, given: set[str], n: int, prec: str):
    """``(Resolved, global batch size)`` of the exact layout asked for, resolved by train's one
    resolution (`modelpar.train.resolve.resolve`: --plan FILE, a --strategy shorthand, or degrees, with
    the plan flags on top), or None when no layout is given (--strategy auto / rules, no degrees, no
    --plan: estimate then answers "does it fit, and how?"). A plan file's global batch is used unless
    --global-batch-size is given; without a plan file, an unset --precision is ``prec`` (the planner
    commands' default, `precision_for`).

    Raises:
        ValueError: what `resolve` raises (contradicting flags, a strategy that cannot use ``n`` ranks,
            a bad plan file), naming the flags and values.
    """
    from modelpar.train.config import TrainConfig
    from modelpar.train.resolve import resolve

    fields, strategy = plan_fields_given(a), strategy_given(a, given)
    if not a.plan and strategy.lower() in ("auto", "rules") and not any(k in fields for k in DEGREES):
        return None
    gbs = global_batch_size_given(a, given)      # a --plan file's, unless given
    if not a.plan:
        fields.setdefault("precision", prec)
    cfg = TrainConfig(model=a.model, model_config=a.model_config, strategy=strategy, plan=a.plan, nproc=n,
                      global_batch_size=gbs, seq_len=a.seq_len, layout=fields)
    return resolve(cfg, n), gbs


def main(argv: list[str]) -> int:
    from modelpar.cli.options import resolve_hardware

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar estimate")
    a = parse(p, argv)
    given = given_fields(p, argv)
    n = run_world_size(a, given, strategy_given(a, given))    # a plan file brings its own world size
    from modelpar.models.spec import check_model
    check_model(a.model, a.model_config)          # bad names fail first, before any note
    hw = resolve_hardware(a.hardware, n, gpus_per_node=a.gpus_per_node)
    prec = precision_for(plan_fields_given(a).get("precision"), hw)
    exact = exact_layout(a, given, n, prec)
    prof, desc = profile_for(a.model, a.model_config, a.seq_len, exact[0].plan.precision if exact else prec,
                             a.blocks)
    if exact is None:
        if a.json:
            raise ValueError("--json describes one exact layout: give --plan FILE, a --strategy or degrees")
        return _fit_answer(a, prof, desc, n, hw, prec)
    return _exact_answer(a, *exact, prof, desc, n, hw)


def _exact_answer(a, resolved, gbs: int, prof, desc, n: int, hw) -> int:
    from modelpar.plan_file import PlanFile
    from modelpar.planner.cost import estimate_step, hfu, mfu
    from modelpar.planner.legality import check_model_takes
    from modelpar.planner.memory import Batch, estimate_memory

    plan = resolved.plan.validate(n, num_blocks=None)
    check_model_takes(prof, plan)                 # what train refuses before launch
    m = plan.n_microbatches if plan.pp > 1 else 1
    if a.micro_batch_size:
        local = a.micro_batch_size * m
        if resolved.local_batch_size and resolved.local_batch_size != local:
            raise ValueError(f"--micro-batch-size {a.micro_batch_size} contradicts the plan file's local batch "
                             f"{resolved.local_batch_size} ({m} micro-batch(es)); drop one")
    elif resolved.local_batch_size:
        local = resolved.local_batch_size
    else:                       # what `train` runs with the same flags (`train.loop.batch_terms`): global / dp
        from modelpar.plan import split_global_batch

        try:
            local = split_global_batch(gbs, plan)
        except ValueError:      # in the flags the user gave
            raise ValueError(f"--global-batch-size {gbs} is not a multiple of the data-parallel degree {plan.dp} "
                             f"(dp_replicate x dp_shard = {plan.dp_replicate} x {plan.dp_shard}): each data-parallel "
                             f"rank needs whole samples; give a --global-batch-size that is a multiple of {plan.dp}, "
                             f"or fewer data-parallel ranks") from None
    batch = Batch(gbs, local)
    if a.micro_batch_size and gbs % (local * plan.dp):       # in the flags the user gave
        per = f" x {m} micro-batches" if m > 1 else ""
        raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {a.micro_batch_size}{per} "
                         f"x {plan.dp} data-parallel rank(s) = {local * plan.dp}; give a --micro-batch-size that makes "
                         f"this product divide it")
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
    print(f"{desc}: {params_phrase(prof)}; {plan.describe()} on {n} x {hw.name} "
          f"({hw.memory_bytes / GIB:.1f} GiB each); global batch {gbs}, local {local}, micro-batch {local // m}, "
          f"accumulation {batch.accumulation_steps(plan)}")
    if plan.precision == "bf16":
        from modelpar.plan import autocasts, runtime_layout

        print("  precision: " + (
            "bf16 under torch.autocast over fp32 parameters (no FSDP2 wrapper in this layout): every matmul "
            "casts its weight and input per use, the residual stream stays fp32" if autocasts(plan) else
            f"bf16 parameters by FSDP2's mixed-precision policy ({runtime_layout(plan).dp_wrapper}): each block's "
            "weights cast once per forward and backward, fp32 master weights, gradients reduced in fp32"))
    rate = f"{tok:,.0f} tokens/s per device" if tok is not None else f"{st.samples_per_s / n:,.1f} samples/s per device"
    print(f"  step {st.total * 1e3:,.1f} ms | MFU {mfu(st, hw, plan.precision):.1%} | HFU "
          f"{hfu(st, hw, plan.precision):.1%} | {rate}")
    print("  step time by part: " + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in st.parts().items() if v))
    print(f"  peak memory per rank ({f'pipeline rank {mem.pp_rank}, ' if plan.pp > 1 else ''}at {mem.phase}):")
    for k, v in mem.parts().items():
        print(f"    {k:<14} {v / GIB:10.3f} GiB")
    print(f"    {'total':<14} {mem.total / GIB:10.3f} GiB of {hw.memory_bytes / GIB:.1f}: "
          f"{'fits' if fits else 'does NOT fit'}")
    return 0 if fits else 1


def _fit_answer(a, prof, desc, n: int, hw, prec: str) -> int:
    from modelpar.plan import plan_for_strategy, split_global_batch
    from modelpar.planner.legality import check_model_takes
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.search import search_plans

    print(f"{desc}: {params_phrase(prof)}; {n} x {hw.name} "
          f"({hw.memory_bytes / GIB:.1f} GiB each), {prec}, micro-batch 1")
    for s in (("single",) if n == 1 else ("ddp", "fsdp", "tp", "pp")):
        try:
            plan = plan_for_strategy(s, n, precision=prec)
            check_model_takes(prof, plan)             # as train refuses it, with its reason
            split_global_batch(a.global_batch_size, plan)
            local = plan.n_microbatches if plan.pp > 1 else 1
            m = estimate_memory(prof, plan, Batch(local * plan.dp, local), optimizer=a.optimizer,
                                overhead_bytes=hw.framework_overhead_bytes)
            fits = "fits" if m.total <= hw.memory_bytes else "does NOT fit"
            print(f"  {s:<6} {m.total / GIB:10.2f} GiB/device  {fits}")
        except ValueError as e:
            print(f"  {s:<6} not applicable: {e}")
    from modelpar.train.resolve import search_settings
    rep = search_plans(prof, n, hw, global_batch_size=a.global_batch_size, optimizer=a.optimizer, precision=prec,
                       top_k=1, **search_settings(plan_fields_given(a)))   # as train --strategy auto's search
    if not rep.ranked:
        print(f"no: nothing fits on {n} devices ({rep.summary()})")
        return 1
    c = rep.ranked[0]
    print(f"yes: best plan {c.plan.describe()} (micro-batch {c.micro_batch_size}), "
          f"{c.memory.total / GIB:.2f} GiB/device, {c.step.total * 1e3:.1f} ms/step")
    return 0
