"""``modelpar calibrate``: measure this machine once (micro-benchmarks, never a model) and save the
hardware profile the planner then uses by default in every command (`modelpar.calibrate`)."""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.cli.args import add_fields, make_parser, normalize_argv, parse
from modelpar.cli.options import LayoutOptions


@dataclass
class CalibrateOptions:
    """Calibration.

    Args:
        out: where to write the profile (JSON; empty: $MODELPAR_CALIBRATION or
            ~/.cache/modelpar/calibration.json, which every command reads by default).
        collectives: also time the collectives between --nproc local ranks.
        rounds: rounds of every compute term and of the collectives timed between compute segments;
            the median over the rounds is kept and their spread recorded (1: fastest, no spread).
        quick: a smoke run that checks the command and its file end to end: every term is measured
            and saved, the slowest on smaller grids (the matmul shape grid on 3 sizes, one pass; the
            zero-bubble and TP chains on smaller inputs); the profile's source says it is not for planning.
    """

    out: str = ""
    collectives: bool = True
    rounds: int = 3
    quick: bool = False


def build_parser():
    p = make_parser("modelpar calibrate", (
        "Measure matmul FLOP/s over a sweep of sizes, per-operation overhead, memory bandwidth, and gloo "
        "all-reduce / all-gather / reduce-scatter / send-recv latency and bandwidth between local ranks; save "
        "them as a JSON hardware profile, read by default by train, plan, estimate and bench (or name it with "
        "--hardware FILE). Only micro-benchmarks are timed, never a model."),
        epilog="examples:\n  modelpar calibrate\n  modelpar calibrate --nproc 4 --out hw.json\n  modelpar calibrate --rounds 1   (quicker, noisier)\n")
    add_fields(p, LayoutOptions, only=("nproc",),
               docs={"nproc": "local ranks that will share this machine in training (memory and cores are split)."})
    add_fields(p, CalibrateOptions)
    return p


def main(argv: list[str]) -> int:
    from modelpar.calibrate import calibrate

    p = build_parser()
    a = parse(p, normalize_argv(argv, p, prog="modelpar calibrate"))
    calibrate(a.out or None, a.nproc, collectives=a.collectives, rounds=a.rounds, quick=a.quick)
    return 0
