"""``modelpar export CHECKPOINT [--out FILE]``: one consolidated safetensors file of a checkpoint
saved under any plan and world size (`modelpar.train.checkpoint.export_checkpoint`)."""

from __future__ import annotations

import sys
from pathlib import Path

from modelpar.cli.args import make_parser, normalize_argv, parse


def build_parser():
    p = make_parser("modelpar export", (
        "Write the model weights of a modelpar checkpoint (saved under any plan and world size) as one "
        "safetensors file with the plain model's parameter names."),
        epilog="examples:\n  modelpar export runs/checkpoints --out model.safetensors   # the latest checkpoint\n")
    p.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNNNN) or a folder of them (the latest)")
    p.add_argument("--out", default="", help="output file (default: CHECKPOINT.safetensors next to it)")
    return p


def main(argv: list[str]) -> int:
    from modelpar.train.checkpoint import CheckpointError, export_checkpoint, resolve_checkpoint

    p = build_parser()
    a = parse(p, normalize_argv(argv, p, prog="modelpar export"))
    try:
        src = resolve_checkpoint(a.checkpoint)
        out = Path(a.out) if a.out else src.parent / f"{src.name}.safetensors"
        sd = export_checkpoint(src, out)
    except CheckpointError as e:
        print(f"modelpar export: error: {e}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in sd.values())
    print(f"wrote {out}: {len(sd)} tensors, {n:,} parameters (from {src})")
    return 0
