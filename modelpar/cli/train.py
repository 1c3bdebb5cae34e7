"""``modelpar train``: resolve the plan once, write the run folder, launch the ranks.

The launcher (this process) checks the whole configuration and resolves the plan once
(`modelpar.train.resolve`), then writes ``config.yaml`` (the effective `TrainConfig`) and
``plan.json`` (`modelpar.plan_file`) into a new run folder and starts ``--nproc`` local ranks with
``modelpar train --run-dir DIR`` (`modelpar.launch`). Every rank reads both files and validates the
plan (the same error on every rank); none plans again. With ``--nnodes`` > 1 it prints the
torchrun / srun line to run on every node instead (the run folder must be on a filesystem every node
sees, as checkpoints already require). Started directly under torchrun without ``--run-dir``, every
rank resolves the configuration itself (deterministic for explicit strategies and for ``auto`` with
the same calibration file).
"""

from __future__ import annotations

import sys
from pathlib import Path

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.options import (BATCH_TERMS, LayoutOptions, add_plan_fields, global_batch_size_given, run_world_size,
                                  strategy_given)

EXAMPLES = """examples:
  modelpar train                                         # the main job: gpt-1m, auto plan, 2 local ranks
  modelpar train --strategy fsdp --nproc 2
  modelpar train --strategy pp --pp-schedule gpipe --n-microbatches 8
  modelpar train --strategy fsdp+tp --nproc 4 --precision bf16 --activation-checkpointing full
  modelpar train --dp-shard 2 --tp 2 --sequence-parallel --nproc 4   # exactly these degrees (custom)
  modelpar train --plan runs/<run>/plan.json             # the layout a plan file names
  modelpar train --config my.yaml --steps 100            # a config file plus overrides
  modelpar train --nnodes 2 --gpus-per-node 8 --dp-shard 4 --tp 4    # prints the per-node launch line
  modelpar train --model hf:gpt2 --model-config '{"n_layer": 4, "n_embd": 256, "vocab_size": 256}' --strategy ddp
  modelpar train --model hf:llama --model-config '{...}' --tokenizer tokenizer.json --strategy fsdp
  modelpar train --model mymodels:lm --data tokens/ --token-dtype uint16 --strategy fsdp   # factory LM, nanoGPT tokens
"""

def build_parser():
    from modelpar.train.config import TrainConfig

    p = make_parser("modelpar train", (
        "Train a model (built-in, a Hugging Face causal LM or image classifier, or a factory language model or "
        "classifier; docs/your-model.md) "
        "with a parallel plan. With no options: the 1M-parameter GPT (gpt-1m) on the Python "
        "standard library's sources, the plan `--strategy auto` picks on 2 local CPU ranks (an uncalibrated "
        "machine is measured once first, ~2 min)."), epilog=EXAMPLES + "\n" + BATCH_TERMS, config_file=True)
    from modelpar.cli.options import shared_docs

    add_fields(p, TrainConfig, skip=("layout",), docs=shared_docs())
    add_plan_fields(p)                          # the same plan flags as verify / estimate / plan
    add_fields(p, LayoutOptions, only=("nnodes", "gpus_per_node"), group="many nodes")
    p.add_argument("--run-dir", default="", help="run in this run folder (its config.yaml and plan.json, "
                   "written by the launcher; what each rank is started with)")
    return p


def parse_train_config(argv: list[str]):
    """``(TrainConfig, parsed namespace, given field names)`` from ``modelpar train`` arguments
    (old underscore spellings accepted with a deprecation note).

    Raises:
        ValueError: a bad argument (jsonargparse's message).
    """
    from modelpar.train.config import TrainConfig

    p = build_parser()
    argv = upgrade_config_files(normalize_argv(argv, p, prog="modelpar train", legacy_underscores=True))
    ns = parse(p, argv)
    given = given_fields(p, argv)
    d = ns.as_dict()
    for k in ("config", "__path__", "nnodes", "gpus_per_node", "run_dir"):
        d.pop(k, None)
    d["strategy"] = strategy_given(ns, given)   # degrees without a strategy: exactly these degrees
    d["global_batch_size"] = global_batch_size_given(ns, given)    # a --plan file's, unless given
    return TrainConfig(**d), ns, given


def upgrade_config_files(argv: list[str]) -> list[str]:
    """``--config FILE`` in the flat form written before `TrainConfig.layout` (``tp: 2``,
    ``plan_options: {...}`` at the top level) -> the same config as YAML text in the current form
    (`TrainConfig.from_dict`'s rules), with one deprecation note; current files are left as they are.

    Raises:
        ValueError: a config file that is not a YAML / JSON mapping, or has unknown keys.
    """
    import yaml

    from modelpar.train.config import PLAN_FIELDS, TrainConfig

    out = list(argv)
    for i, a in enumerate(argv):
        path = a.partition("=")[2] if a.startswith("--config=") else (argv[i + 1] if a == "--config" and
                                                                        i + 1 < len(argv) else "")
        if not path or not Path(path).is_file():
            continue
        d = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(d, dict):
            raise ValueError(f"--config {path!r}: expected a mapping of TrainConfig fields, got {type(d).__name__}")
        flat = sorted(k for k in d if k in PLAN_FIELDS or k == "plan_options")
        if not flat:
            continue
        print(f"modelpar train: note: --config {path}: plan fields at the top level ({', '.join(flat)}) are "
              f"deprecated; put them under 'layout:' (as a run folder's config.yaml does)", file=sys.stderr)
        text = yaml.safe_dump(TrainConfig.from_dict(d, where=f"--config {path}").to_dict(), sort_keys=False)
        if a == "--config":
            out[i + 1] = text
        else:
            out[i] = "--config=" + text
    return out


def write_run_folder(cfg, resolved, batches, run_dir: Path) -> None:
    """``config.yaml`` (the effective config) and ``plan.json`` (plan + batch terms) in ``run_dir``."""
    import yaml

    from modelpar.plan_file import PlanFile

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    PlanFile(resolved.plan, batches.global_batch_size, batches.local_batch_size, resolved.reason).write(
        run_dir / "plan.json")


def read_run_folder(run_dir: Path):
    """``(TrainConfig, Resolved)`` from a run folder written by `write_run_folder`.

    Raises:
        ValueError: a missing file, unknown config keys, or a plan file that does not parse.
    """
    import yaml

    from modelpar.plan_file import read_plan_file
    from modelpar.train.config import TrainConfig
    from modelpar.train.resolve import Resolved

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ValueError(f"--run-dir {str(run_dir)!r} has no config.yaml (written by the launcher)")
    d = yaml.safe_load(cfg_path.read_text()) or {}
    cfg = TrainConfig.from_dict(d, where=str(cfg_path))     # also a run folder written before `layout`
    pf = read_plan_file(run_dir / "plan.json")
    return cfg, Resolved(pf.plan, pf.local_batch_size or 0, pf.source)


def expected_rate_line(cfg, tokens_per_s: float) -> str:
    """``expected ~N tokens/s on this machine (planner prediction)``: the planner's predicted
    throughput of the chosen plan (``--strategy auto``, language models), N rounded to two significant
    digits; "this machine" is its calibration (``--hardware`` empty), else the named profile."""
    digits = max(0, len(str(int(tokens_per_s))) - 2)
    where = "this machine" if not cfg.hardware else cfg.hardware
    return f"expected ~{round(tokens_per_s, -digits):,.0f} tokens/s on {where} (planner prediction)"


def warmup_note(cfg) -> str:
    """A note when the run ends before its warm-up does ("" otherwise): the learning rate never
    reaches ``--lr`` (a fresh user's 20-step trial under the default 40 warm-up steps)."""
    if cfg.warmup_steps <= cfg.steps:
        return ""
    return (f"--warmup-steps {cfg.warmup_steps} > --steps {cfg.steps}: the learning rate rises linearly the whole "
            f"run and never reaches --lr {cfg.lr}; give fewer warm-up steps for the full schedule")


def long_sequence_note(cfg) -> str:
    """A note when ``--seq-len`` takes a built-in GPT past its preset's positions ("" otherwise): its
    learned position table grows with the length (HF models refuse a length past their configured
    positions instead; a GPT preset sizes the table to the request), and attention's work with its
    square, so the run can be far larger and slower than the preset's name says."""
    from modelpar.models import PRESETS

    if cfg.model not in PRESETS or not cfg.seq_len:
        return ""
    base = PRESETS[cfg.model]
    d = int((cfg.model_config or {}).get("d_model", base.d_model))
    preset_len = int((cfg.model_config or {}).get("seq_len", base.seq_len))
    if cfg.seq_len <= preset_len:
        return ""
    return (f"--seq-len {cfg.seq_len:,} is past {cfg.model}'s {preset_len:,} positions: its learned position table "
            f"grows to {cfg.seq_len:,} x {d} ({cfg.seq_len * d / 1e6:,.1f}M parameters) and attention's work per "
            f"sample by ({cfg.seq_len:,} / {preset_len:,})^2 = {(cfg.seq_len / preset_len) ** 2:,.0f}x; "
            f"`modelpar estimate` prices a step first")


def _train_or_stop(train, cfg, **kw) -> int:
    """Exit code of a rank's run: 0 when it trained to the end, 128 + the signal's number when a stop
    request (`modelpar.train.stop`) ended it after a checkpoint (the runner said so on rank 0)."""
    from modelpar.train.stop import RunStopped

    try:
        train(cfg, **kw)
    except RunStopped as e:
        return 128 + e.signum
    return 0


def main(argv: list[str]) -> int:
    from modelpar.launch import multinode_commands, run_command, under_launcher
    from modelpar.rank_outcome import run_rank_and_exit
    from modelpar.train.loop import check_factory_forward, preflight
    from modelpar.train.resolve import resolve, with_run_precision
    from modelpar.train.runner import make_run_dir, train

    cfg, ns, given = parse_train_config(argv)
    if not ns.run_dir:
        from modelpar.cli.options import check_option_ranges

        check_option_ranges(ns)                 # before anything reads a degree or a size
        cfg = with_run_precision(cfg)           # unset: bf16 on a GPU, fp32 on the CPU, as plan prices
    if ns.run_dir:                              # a rank of a resolved run: read, validate, train
        cfg, resolved = read_run_folder(Path(ns.run_dir))
        if not under_launcher():
            return _train_or_stop(train, cfg, run_dir=Path(ns.run_dir), resolved=resolved)
        run_rank_and_exit(lambda: _train_or_stop(train, cfg, run_dir=Path(ns.run_dir), resolved=resolved),
                          "modelpar train")     # an error: reported, no teardown
    if under_launcher():                        # started by the user's own torchrun
        run_rank_and_exit(lambda: _train_or_stop(train, cfg), "modelpar train")
    from modelpar.models.spec import check_model
    check_model(cfg.model, cfg.model_config)    # as plan / verify: e.g. --model-config on a factory model
    if cfg.hardware:                            # a name or file plan / estimate would refuse: refused here too
        from modelpar.planner.hardware import get_hardware
        get_hardware(cfg.hardware)
    world = run_world_size(ns, given, cfg.strategy)     # 1 for single / placement; a plan file's own
    from modelpar.models.spec import one_factory_build
    with one_factory_build():                   # a factory model: built once for these checks, then dropped
        check_factory_forward(cfg)              # a factory model of a form train cannot run: one line, now
        from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
        from modelpar.train.task import build_task, unused_lm_options_note

        meta_task = build_task(cfg, device="meta", load_data=False)
        meta_model = meta_task.model
        unused = unused_lm_options_note(cfg, meta_task.kind)
        del meta_task
        check_checkpoints_before_launch(cfg, meta_model)    # as every rank would refuse them: once, before
        # only train --strategy auto calibrates by itself (rules and the rest: the uncalibrated estimate)
        resolved = resolve(cfg, world, measure_if_missing=cfg.strategy.lower() == "auto")   # (minutes)
        plan, batches = preflight(cfg, world, resolved)
        if ns.nnodes == 1:                      # the ranks' builds and CPU training state on this host
            import torch

            from modelpar.train.host_memory import check_host_memory, host_memory_available

            on_cpu = (all(str(d).startswith("cpu") for d in plan.placement_devices) if plan.is_placement
                      else not torch.cuda.is_available())
            check_host_memory(cfg, plan, meta_model, world, host_memory_available(), on_cpu=on_cpu)
        del meta_model
    for note in (long_sequence_note(cfg), unused, warmup_note(cfg)):
        if note:
            print(f"modelpar train: note: {note}", flush=True)
    print(f"plan: {plan.describe()} on {world} rank(s) -- {resolved.reason}", flush=True)
    if resolved.predicted_tokens_per_s > 0:     # what the user should expect (README: the hosts' range)
        print(expected_rate_line(cfg, resolved.predicted_tokens_per_s), flush=True)
    run_dir = make_run_dir(cfg, plan)
    write_run_folder(cfg, resolved, batches, run_dir)
    text = (run_dir / "config.yaml").read_text()
    print(f"effective config (layout: the fields given; null ones are the plan's, {plan.describe()}):\n"
          + "\n".join("  " + l for l in text.strip().splitlines()), flush=True)
    print(f"run folder: {run_dir} (config.yaml, plan.json)", flush=True)
    target = ["-m", "modelpar", "train", "--run-dir", str(run_dir)]
    if ns.nnodes > 1:
        print(multinode_commands(target, nnodes=ns.nnodes, nproc_per_node=world // ns.nnodes))
        return 0
    if world == 1:                              # a stop request ends it as it ends a rank: 128 + the signal
        return _train_or_stop(train, cfg, run_dir=run_dir, resolved=resolved)
    code, msg = run_command(target, world).report("modelpar train")
    if msg:                                     # a rank's error is printed above; this names the first
        print(msg, file=sys.stderr)
    return code
