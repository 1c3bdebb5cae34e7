"""``modelpar plan``: rank every parallel layout of a model on N devices by predicted throughput."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.common import GIB, PlannerOptions, precision_for, profile_for
from modelpar.cli.options import BATCH_TERMS, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions, PartsOptions, world_size

EXAMPLES = """examples:
  modelpar plan --model gpt-1b --nproc 8 --hardware H100-80GB-SXM
  modelpar plan --model gpt-70b --nnodes 8 --gpus-per-node 8 --hardware H100-80GB-SXM --top 5
  modelpar plan --model gpt-1m --explain 1 --json > plan.json      # then: modelpar train --plan plan.json
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


@dataclass
class SearchSpace:
    """Which checkpointing modes the search tries.

    Args:
        activation_checkpointing: search only this mode (none, full, selective, every-k; empty: all).
        ac_every: k of every-k (0: the search tries 2 and 4).
    """

    activation_checkpointing: str = ""
    ac_every: int = 0


def search_kwargs(activation_checkpointing: str, ac_every: int) -> dict:
    """`search_plans`' checkpointing arguments from --activation-checkpointing / --ac-every.

    Raises:
        ValueError: an unknown mode or a k below 1 (naming the flag).
    """
    from modelpar.plan import AC_MODES

    kw: dict = {}
    if activation_checkpointing:
        if activation_checkpointing not in AC_MODES:
            raise ValueError(f"--activation-checkpointing {activation_checkpointing!r} is unknown; "
                             f"valid: {', '.join(AC_MODES)}")
        kw["checkpointing"] = (activation_checkpointing,)
    if ac_every:
        if ac_every < 1:
            raise ValueError(f"--ac-every must be >= 1, got {ac_every}")
        kw["ac_every"] = (ac_every,)
    return kw


def build_parser():
    p = make_parser("modelpar plan", (
        "Predict memory per device and step time of every parallel layout (dp_replicate x dp_shard x tp x pp, "
        "schedules, micro-batches, checkpointing) and print the fastest that fit."),
        epilog=EXAMPLES + "\n" + BATCH_TERMS)
    add_fields(p, ModelOptions)
    add_fields(p, PartsOptions, only=("blocks",))
    add_fields(p, LayoutOptions, only=("nproc", "nnodes", "gpus_per_node"))
    add_fields(p, BatchOptions)
    add_fields(p, HardwareOptions)
    add_fields(p, PlannerOptions)
    add_fields(p, SearchSpace)
    add_fields(p, PlanCommand)
    return p


def _row(i, c, hw, prec) -> str:
    from modelpar.planner.cost import mfu
    st = c.step
    rate = f"{st.tokens_per_s:,.0f} tok/s" if st.tokens_per_sample > 1 else f"{st.samples_per_s:,.1f} smp/s"
    return (f"{i:>3} {c.plan.describe():<58} {c.micro_batch_size:>4} {c.memory.total / GIB:>8.2f} "
            f"{st.total * 1e3:>10.1f} {rate:>18} {mfu(st, hw, prec):>6.1%} {st.comm_share:>6.1%} "
            f"{st.bubble_share:>6.1%}")


def main(argv: list[str]) -> int:
    from modelpar.cli.options import resolve_hardware
    from modelpar.plan_file import PlanFile
    from modelpar.planner.search import search_plans

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar plan")
    a = parse(p, argv)
    n = world_size(a, given_fields(p, argv))
    if a.json and not a.explain:
        raise ValueError("--json prints one plan file: give --explain K too")
    from modelpar.models.spec import check_model
    check_model(a.model, a.model_config)          # bad names fail first, before any note
    hw = resolve_hardware(a.hardware, n, gpus_per_node=a.gpus_per_node)
    prec = precision_for(a.precision, hw)
    prof, desc = profile_for(a.model, a.model_config, a.seq_len, prec, a.blocks)
    t = time.perf_counter()
    # only the plans printed (and the one explained) are needed: the exact top-k mode ranks just those
    # (the summary then says how many were evaluated and found feasible, a lower bound on the total)
    rep = search_plans(prof, n, hw, global_batch_size=a.global_batch_size, optimizer=a.optimizer, precision=prec,
                       top_k=max(a.top, a.explain, 1), **search_kwargs(a.activation_checkpointing, a.ac_every))
    if a.explain and not 1 <= a.explain <= len(rep.ranked):
        raise ValueError(f"--explain {a.explain}: only {len(rep.ranked)} plans are feasible")
    if a.json:
        c = rep.ranked[a.explain - 1]
        pf = PlanFile(c.plan, c.batch.global_batch_size, c.batch.local_batch_size,
                      f"modelpar plan --model {a.model}: plan {a.explain} of >= {rep.topk_stats['fitting']} feasible "
                      f"on {n} x {hw.name}")
        print(json.dumps(pf.to_dict(), indent=1, sort_keys=True))
        return 0
    print(f"{desc} ({prof.num_params / 1e6:,.1f}M params) on {n} x {hw.name}, "
          f"global batch {a.global_batch_size}, {prec}: {rep.summary()} [{time.perf_counter() - t:.2f} s]")
    if not rep.ranked:
        print("no plan fits; reasons above")
        return 1
    print(f"{'#':>3} {'plan':<58} {'mb':>4} {'GiB/dev':>8} {'step ms':>10} {'throughput':>18} "
          f"{'MFU':>6} {'comm':>6} {'bubble':>6}")
    for i, c in enumerate(rep.ranked[:a.top], 1):
        print(_row(i, c, hw, prec))
    if a.explain:
        c = rep.ranked[a.explain - 1]
        print(f"\nplan {a.explain}: {c.plan.describe()}  local batch {c.batch.local_batch_size}, "
              f"micro-batch {c.micro_batch_size}\n  {c.plan.to_json()}")
        print(f"  memory per device (pipeline rank {c.memory.pp_rank}, peak at {c.memory.phase}):")
        for k, v in c.memory.parts().items():
            print(f"    {k:<14} {v / GIB:10.3f} GiB")
        print(f"    {'total':<14} {c.memory.total / GIB:10.3f} GiB of {hw.memory_bytes / GIB:.1f}")
        print("  step time:")
        for k, v in c.step.parts().items():
            print(f"    {k:<14} {v * 1e3:10.2f} ms {v / c.step.total:6.1%}")
        print(f"    {'total':<14} {c.step.total * 1e3:10.2f} ms")
    return 0
