"""`modelpar` command line: train | plan | estimate | calibrate | verify | bench | export.

Each subcommand has its own ``--help``. ``modelpar train`` checks the whole configuration before any
process starts, then launches ``--nproc`` local ranks through torch's elastic launcher
(`torch.distributed.run`); under ``torchrun`` the same entry point runs as one rank.
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: modelpar <command> [options]   (modelpar <command> --help for each)

commands:
  train      train a model with a parallel plan (default: the GPT on the Python stdlib, 2 CPU ranks)
  plan       rank every parallel plan of a model on N devices by predicted throughput
  estimate   does model X fit on N devices of type Y, and how?
  calibrate  measure this machine (matmul FLOP/s, collectives) for the planner
  verify     train N steps under a plan and on one process; compare losses and parameters
  bench      measure throughput, memory per device and communication share of strategies
  export     write a checkpoint as one consolidated safetensors file
"""

# command -> "module:function"; each function takes the remaining argv and returns an exit code.
COMMANDS = {
    "plan": "modelpar.planner.commands:plan_main",
    "estimate": "modelpar.planner.commands:estimate_main",
    "calibrate": "modelpar.planner.commands:calibrate_main",
    "verify": "modelpar.verify_cmd:verify_main",
    "bench": "modelpar.bench.cli:bench_main",
    "export": "modelpar.train.checkpoint:export_main",
}


CONFIG_ENV = "MODELPAR_TRAIN_CONFIG"


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def train_parser():
    from argparse import RawDescriptionHelpFormatter

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    from modelpar.train.config import TrainConfig

    class _Formatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
        """jsonargparse's formatter, keeping the description's line breaks (the examples)."""

    p = ArgumentParser(prog="modelpar train", formatter_class=_Formatter, description=(
        "Train a built-in model with a parallel plan. With no options: the 3M-parameter GPT on the Python "
        "standard library's sources, the plan `--strategy auto` picks on 2 local CPU ranks. Examples:\n"
        "  modelpar train --strategy fsdp --nproc 2\n"
        "  modelpar train --strategy pp --pp_schedule gpipe --n_microbatches 4\n"
        "  modelpar train --strategy fsdp+tp --nproc 4 --precision bf16\n"
        "  torchrun --nproc-per-node 8 -m modelpar train --dp_shard 2 --tp 4   (multi-node: add --nnodes)"),
        default_config_files=[], env_prefix="MODELPAR", default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file of the options below")
    p.add_class_arguments(TrainConfig)
    return p


def parse_train_config(argv: list[str]):
    from modelpar.train.config import TrainConfig

    p = train_parser()
    ns = p.parse_args(argv)
    d = ns.as_dict()
    d.pop("config", None)
    d.pop("__path__", None)
    return TrainConfig(**d), p.dump(ns, skip_none=False)


def cmd_train(argv: list[str]) -> int:
    from modelpar.train.loop import preflight
    from modelpar.train.runner import train

    if not argv and os.environ.get(CONFIG_ENV):      # a rank started by our own launch below
        argv = ["--config", os.environ[CONFIG_ENV]]
    cfg, dumped = parse_train_config(argv)
    if _under_launcher():
        from modelpar.rank_outcome import run_rank_and_exit

        run_rank_and_exit(lambda: (train(cfg), 0)[1], "modelpar train")   # an error: reported, no teardown
    world = 1 if cfg.strategy in ("single", "placement") else cfg.nproc
    try:
        plan, _ = preflight(cfg, world)
    except ValueError as e:
        print(f"modelpar train: error: {e}", file=sys.stderr)
        return 2
    if cfg.strategy.lower() in ("auto", "rules"):
        from modelpar.train.auto import choose_for_config, export_choice

        print(f"strategy {cfg.strategy}: {plan.describe()} -- "
              f"{choose_for_config(cfg, world, strategy=cfg.strategy.lower()).reason}", flush=True)
        export_choice(cfg, world, cfg.strategy.lower())
    print("effective config:\n" + "\n".join("  " + l for l in dumped.strip().splitlines()), flush=True)
    if world == 1:
        train(cfg)
        return 0
    from torch.distributed.run import main as torchrun

    # The ranks read the effective config from a file (not from argv: torchrun's own parser would
    # claim options such as --nproc), so every rank runs exactly what was checked here.
    import tempfile

    fd, cfg_path = tempfile.mkstemp(prefix="modelpar-train-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(dumped)
    os.environ[CONFIG_ENV] = cfg_path
    args = ["--standalone", f"--nproc-per-node={world}", "--max-restarts=0", "-m", "modelpar", "train"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(args)
    except Exception as e:          # ChildFailedError: the ranks' own errors were printed above
        print(f"modelpar train: a rank failed: {type(e).__name__}: {str(e).strip()[:2000]}", file=sys.stderr)
        return 1
    finally:
        os.unlink(cfg_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return cmd_train(rest)
    if cmd in COMMANDS:
        import importlib

        mod, fn = COMMANDS[cmd].split(":")
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("modelpar"):
                print(f"modelpar {cmd}: not available in this version ({e.name} is missing)", file=sys.stderr)
                return 2
            raise
        try:
            return getattr(module, fn)(rest)
        except ValueError as e:     # bad input: one line, no traceback
            print(f"modelpar {cmd}: error: {e}", file=sys.stderr)
            return 2
    print(f"modelpar: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2
