"""The option groups every command shares: same flag names, same defaults, same meaning.

`TrainConfig` holds the same fields with the same defaults (a test checks it), so ``modelpar train``
and ``modelpar plan`` answer for the same job when given the same flags.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from modelpar.plan import DEGREES  # re-exported: the commands' degree flags

BATCH_TERMS = """batch terms (one meaning each, in every command):
  global batch size  samples per optimizer step (the same on every layout)
  local batch size   samples in one forward/backward on one data-parallel rank
  micro-batch size   samples per pipeline micro-batch (= local under no pipeline)
  accumulation       global / (local x data-parallel degree), derived"""


@dataclass
class ModelOptions:
    """Which model.

    Args:
        model: a built-in name (gpt-nano, gpt-1m, gpt-3m, gpt-10m .. gpt-70b, mlp-small, mlp-large,
            mlp-deep, cnn), your own as module:factory or path/to/file.py:factory (the factory protocol
            is in modelpar/models/spec.py), or a Hugging Face model: hf:<model_type> (hf:llama, hf:gpt2,
            hf:vit, ...), a config.json path or a local pretrained folder (docs/your-model.md).
        model_config: JSON object of overrides: GPTConfig fields of a GPT preset, e.g.
            '{"n_layer": 32, "d_model": 4096, "n_head": 32}', or fields of a Hugging Face config, e.g.
            '{"num_hidden_layers": 4}'.
    """

    model: str = "gpt-1m"                 # the main job's (TrainConfig.model): one default everywhere
    model_config: dict = dataclasses.field(default_factory=dict)


@dataclass
class PartsOptions:
    """Where the model is cut (pipelines, layer placement, per-block FSDP and checkpointing).

    Args:
        blocks: path of the nn.ModuleList / nn.Sequential holding the repeated blocks, e.g.
            hf.model.layers (empty: the longest run of one class in any such container).
        split_points: comma-separated block paths, each starting a pipeline stage, e.g.
            hf.model.layers.2 for 2 stages (empty: the planner's split, `modelpar.stage_split`).
    """

    blocks: str = ""
    split_points: str = ""


@dataclass
class LayoutOptions:
    """How many ranks, and which layout.

    Args:
        nproc: world size (ranks; train and verify launch this many local ranks, ignored under
            torchrun, which sets the world size).
        nnodes: nodes (with --gpus-per-node: world size = nnodes x gpus-per-node; train and verify
            then print the torchrun / srun line to run on every node).
        gpus_per_node: devices per node, the fast-link domain (0: the hardware profile's).
        strategy: auto (the planner picks the fastest plan that fits; plan: every layout ranked),
            rules (the rule-of-thumb plan), custom (exactly the degrees given), or a shorthand: single,
            placement, ddp, fsdp, hsdp, tp, pp, ddp+tp, fsdp+tp (plan: only that family ranked). A
            degree that contradicts the shorthand is an error; degrees without --strategy mean custom.
        plan: a plan file (plan.json as `plan --explain K --json`, `estimate --json` or a run folder
            writes it) or its JSON text: the whole layout, instead of --strategy and degrees.
    """

    nproc: int = 2
    nnodes: int = 1
    gpus_per_node: int = 0
    strategy: str = "auto"
    plan: str = ""


@dataclass
class BatchOptions:
    """Batch and sequence.

    Args:
        global_batch_size: samples per optimizer step (default: the main job's, `TrainConfig`).
        seq_len: tokens per sample for language models (0: a GPT preset's; for a Hugging Face model
            min(its max_position_embeddings, 1024); a factory language model's max_positions; the same in
            every command).
    """

    global_batch_size: int = 16
    seq_len: int = 0


@dataclass
class HardwareOptions:
    """Device profile.

    Args:
        hardware: a built-in device (A100-40GB, A100-80GB, H100-80GB-SXM, H200), cpu (uncalibrated
            estimate), a JSON file written by `modelpar calibrate`, or empty: this machine (its
            calibration if there is one, else the uncalibrated estimate, said in one line).
    """

    hardware: str = ""


SHARED = (ModelOptions, PartsOptions, LayoutOptions, BatchOptions, HardwareOptions)


def shared_docs() -> dict:
    """Field name -> its help text over every shared group (the one source of each shared flag's help)."""
    from modelpar.cli.args import field_docs

    return {k: v for cls in SHARED for k, v in field_docs(cls).items()}


def shared_defaults() -> dict:
    """Field name -> default over every shared group."""
    out = {}
    for cls in SHARED:
        for f in dataclasses.fields(cls):
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def resolve_hardware(name: str, local_ranks: int, *, gpus_per_node: int = 0, say=None):
    """The profile ``--hardware`` names, or this machine's (never measured here: only ``train
    --strategy auto`` calibrates by itself); prints the one-line note when it is the uncalibrated
    estimate or its ranks outnumber the cores. ``gpus_per_node`` > 0 replaces the profile's ``devices_per_node``.

    Raises:
        ValueError: an unknown name or missing file.
    """
    from modelpar.planner.hardware import get_hardware

    if name:
        hw = get_hardware(name, local_ranks=local_ranks)
    else:
        from modelpar.calibrate import machine_hardware

        hw, note = machine_hardware(local_ranks)
        if "uncalibrated" in note or "local ranks share" in note:     # (ranks beyond the cores)
            (say or (lambda m: print(m, file=sys.stderr)))(note)
    if gpus_per_node:
        hw = dataclasses.replace(hw, devices_per_node=gpus_per_node)
    return hw


# option -> (lowest valid value, whether the bound itself is valid); each applies where a command has the option
OPTION_RANGES = {"nproc": (1, True), "nnodes": (1, True), "global_batch_size": (1, True), "steps": (1, True),
                 "eval_samples": (1, True), "log_every": (1, True), "timeout_s": (0, False), "top": (1, True),
                 "explain": (0, True),
                 **dict.fromkeys(("seq_len", "micro_batch_size", "local_batch_size", "lr", "min_lr", "warmup_steps",
                                  "weight_decay", "grad_clip", "dropout", "eval_every", "ckpt_every", "keep_last",
                                  "threads", "sample_bytes", "gpus_per_node"), (0, True))}


POSITIVE_PLAN_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "n_microbatches", "virtual_stages", "ac_every")


def check_option_ranges(ns) -> None:
    """Refuse a numeric option outside its range (`OPTION_RANGES`; ``--dropout`` also below 1) before any
    work, naming the option and the value: each would otherwise fail inside the ranks or be taken silently
    (a negative ``--warmup-steps`` changes the schedule, a negative ``--grad-clip`` turns clipping off).

    Raises:
        ValueError: the first option out of range."""
    for k, (low, closed) in OPTION_RANGES.items():
        v = getattr(ns, k, None)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if v < low or (v == low and not closed) or (k == "dropout" and v >= 1):
            want = ">= 0 and < 1" if k == "dropout" else f"{'>=' if closed else '>'} {low}"
            raise ValueError(f"--{k.replace('_', '-')} must be {want}, got {v}")
    lr, min_lr = getattr(ns, "lr", None), getattr(ns, "min_lr", None)
    if isinstance(lr, (int, float)) and isinstance(min_lr, (int, float)) and min_lr > lr:
        raise ValueError(f"--min-lr {min_lr} is above --lr {lr}: the schedule decays from --lr to --min-lr after "
                         f"the warm-up; give a --min-lr <= --lr")
    for k, v in plan_fields_given(ns).items():   # the layout's degrees and counts: sizes of mesh axes and splits
        if k in POSITIVE_PLAN_FIELDS and isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")


def world_size(ns, given: set[str]) -> int:
    """``--nproc``, or ``--nnodes x --gpus-per-node`` when both are given (``--nproc`` then must agree).

    Raises:
        ValueError: the two disagree, or an option out of its range (`check_option_ranges`: every command
            asks for the world size before any work).
    """
    check_option_ranges(ns)
    if ns.nnodes > 1 or ("gpus_per_node" in given and "nnodes" in given):
        if ns.gpus_per_node < 1:
            raise ValueError(f"--nnodes {ns.nnodes} needs --gpus-per-node (devices per node)")
        n = ns.nnodes * ns.gpus_per_node
        if "nproc" in given and ns.nproc != n:
            raise ValueError(f"--nproc {ns.nproc} disagrees with --nnodes {ns.nnodes} x --gpus-per-node "
                             f"{ns.gpus_per_node} = {n}; give one of them")
        return n
    return ns.nproc



def add_plan_fields(p, only=None) -> None:
    """The plan flags: one per `ParallelPlan` field (``--tp``, ``--pp-schedule``, ``--sequence-parallel``,
    ...; ``only``: those fields), value in ``layout.<field>``, None while not given
    (`modelpar.train.config.PlanOptions`, help from `plan_option_docs`). The same flags, defaults and help
    in every command that takes them (train, verify, estimate; plan: the fields of its search)."""
    from modelpar.cli.args import add_fields
    from modelpar.train.config import PlanOptions, plan_option_docs

    add_fields(p, PlanOptions, only=only, dest_prefix="layout.", docs=plan_option_docs(),
               group="parallel plan (unset: --strategy / --plan decide)")


def plan_fields_given(ns) -> dict:
    """The plan fields set on the command line (``layout.<field>`` not None), lists as given."""
    layout = getattr(ns, "layout", None)
    return {k: v for k, v in vars(layout).items() if v is not None} if layout is not None else {}


def strategy_given(ns, given: set[str]) -> str:
    """``--strategy``, or ``custom`` when degrees are given without ``--strategy`` and ``--plan``
    (degrees alone mean exactly these degrees, in every command)."""
    degrees = any(k in plan_fields_given(ns) for k in DEGREES)
    return "custom" if degrees and "strategy" not in given and not ns.plan else ns.strategy


def run_world_size(ns, given: set[str], strategy: str) -> int:
    """The world size a layout request runs on: 1 for ``single`` / ``placement`` (one process), a
    ``--plan`` file's own world size unless ``--nproc`` / ``--nnodes`` is given, else `world_size`.

    Raises:
        ValueError: what `world_size` or `modelpar.plan_file.read_plan_file` raise.
    """
    if strategy.lower() in ("single", "placement"):
        check_option_ranges(ns)                 # (`world_size` checks them on the other paths)
        for k in ("nproc", "nnodes"):
            if k in given and getattr(ns, k, 1) != 1:
                raise ValueError(f"--strategy {strategy} runs one process; --{k} {getattr(ns, k)} does not apply"
                                 + (" (its devices: --placement-devices)" if strategy.lower() == "placement" else ""))
        return 1
    if ns.plan and "nproc" not in given and "nnodes" not in given:
        check_option_ranges(ns)
        from modelpar.plan_file import read_plan_file

        return read_plan_file(ns.plan).plan.world_size
    return world_size(ns, given)


def global_batch_size_given(ns, given: set[str]) -> int:
    """``--global-batch-size`` (samples per optimizer step), or, when it is not given, the global batch
    of the ``--plan`` file if the file names one: a plan file brings its batch terms in every command
    (a given value that differs is refused by the resolution, naming both).

    Raises:
        ValueError: what `modelpar.plan_file.read_plan_file` raises.
    """
    if ns.plan and "global_batch_size" not in given:
        from modelpar.plan_file import read_plan_file

        gbs = read_plan_file(ns.plan).global_batch_size
        if gbs is not None:
            return gbs
    return ns.global_batch_size
