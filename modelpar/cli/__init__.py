"""`modelpar` command line: train | plan | estimate | calibrate | verify | bench | export.

One module per command (`modelpar.cli.train`, ...), one argument library (jsonargparse, parsers
built from typed dataclasses: `modelpar.cli.args`), one spelling (dashes), and the option groups of
`modelpar.cli.options` shared by every command with the same names and defaults. Each command's
``main(argv) -> exit code``; bad input is one line ``modelpar CMD: error: ...`` and exit code 2.
"""

from __future__ import annotations

import sys

USAGE = """usage: modelpar <command> [options]   (modelpar <command> --help for each)

commands:
  train      train a model with a parallel plan (default: the GPT on the Python stdlib, 2 CPU ranks)
  plan       rank every parallel plan of a model on N devices by predicted throughput
  estimate   does model X fit on N devices of type Y, and how? (--plan FILE: one exact layout)
  calibrate  measure this machine (matmul FLOP/s, collectives) for the planner
  verify     train N steps under a plan and on one process; compare losses and parameters
  bench      measure throughput, memory per device and communication share of strategies
  export     write a checkpoint as one consolidated safetensors file

shared options (same names and defaults everywhere): --model, --model-config, --nproc, --nnodes,
--gpus-per-node, --global-batch-size, --seq-len, --hardware, --plan, --strategy
"""

COMMANDS = ("train", "plan", "estimate", "calibrate", "verify", "bench", "export")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"modelpar: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    import importlib

    from modelpar.cli.args import report_errors

    module = importlib.import_module(f"modelpar.cli.{cmd}")
    return report_errors(module.main, rest, f"modelpar {cmd}")     # bad input: one line, no traceback


def parser_for(cmd: str):
    """The jsonargparse parser of ``modelpar CMD`` (for tests and docs)."""
    import importlib

    return importlib.import_module(f"modelpar.cli.{cmd}").build_parser()
