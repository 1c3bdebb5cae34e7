"""``modelpar export CHECKPOINT [--out PATH] [--format auto|safetensors|hf]``: the model of a
checkpoint saved under any plan and world size, as one consolidated safetensors file
(`modelpar.train.checkpoint.export.export_checkpoint`) or, for a Hugging Face model, as a transformers folder
(`modelpar.train.checkpoint.export.export_hf_folder`; the checkpoint records the model's config, so no
``--model`` is needed)."""

from __future__ import annotations

import sys
from pathlib import Path

from modelpar.cli.args import make_parser, normalize_argv, parse

FORMATS = ("auto", "safetensors", "hf")


def build_parser():
    p = make_parser("modelpar export", (
        "Write the model weights of a modelpar checkpoint (saved under any plan and world size) as one "
        "safetensors file with the plain model's parameter names, or, for a Hugging Face model, as a folder "
        "(config.json + model.safetensors) that transformers' from_pretrained loads."),
        epilog="examples:\n  modelpar export runs/checkpoints --out model.safetensors   # the latest checkpoint\n"
               "  modelpar export runs/checkpoints --out my-gpt2                 # an HF model: a folder\n")
    p.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNNNN) or a folder of them (the latest)")
    p.add_argument("--out", default="", help="output file or folder (default: next to the checkpoint, "
                   "CHECKPOINT.safetensors or CHECKPOINT-hf/)")
    p.add_argument("--format", default="auto", help="auto (hf for a Hugging Face model unless --out ends in .safetensors, "
                   "else safetensors), "
                   "safetensors (one file, modelpar's parameter names) or hf (a transformers folder)")
    return p


def _hf_kind(src) -> bool:
    """Whether the checkpoint ``src`` holds a Hugging Face model."""
    from modelpar.train.checkpoint import read_checkpoint_meta
    from modelpar.train.checkpoint.export import checkpoint_model_spec

    return checkpoint_model_spec(read_checkpoint_meta(src)).get("kind") == "hf"


def main(argv: list[str]) -> int:
    from modelpar.train.checkpoint import CheckpointError, read_checkpoint_meta, resolve_checkpoint
    from modelpar.train.checkpoint.export import export_checkpoint, export_hf_folder

    p = build_parser()
    a = parse(p, normalize_argv(argv, p, prog="modelpar export"))
    if a.format not in FORMATS:
        print(f"modelpar export: error: --format {a.format!r} is unknown; valid: {', '.join(FORMATS)}",
              file=sys.stderr)
        return 2
    try:
        src = resolve_checkpoint(a.checkpoint)
        fmt = a.format
        if fmt == "auto":           # an --out that names a .safetensors file asks for the file, any model
            fmt = "hf" if _hf_kind(src) and not a.out.endswith(".safetensors") else "safetensors"
        if fmt == "hf":
            out = Path(a.out) if a.out else src.parent / f"{src.name}-hf"
            out, sd = export_hf_folder(src, out)
        else:
            out = Path(a.out) if a.out else src.parent / f"{src.name}.safetensors"
            if out.is_dir():
                raise ValueError(f"--out {str(out)!r} is a folder; safetensors export writes one file: give its path "
                                 f"(e.g. {str(out / 'model.safetensors')!r})"
                                 + (" or --format hf for a transformers folder" if _hf_kind(src) else ""))
            sd = export_checkpoint(src, out)
    except (CheckpointError, ValueError) as e:
        print(f"modelpar export: error: {e}", file=sys.stderr)
        return 2
    aliases = {n for tie in read_checkpoint_meta(src).get("tied_parameters", []) for n in tie[1:]} & set(sd)
    n = sum(v.numel() for k, v in sd.items() if k not in aliases)      # a tie's parameters once
    what = "a transformers folder (config.json, model.safetensors)" if fmt == "hf" else "one safetensors file"
    tied = f"; {len(aliases)} tied name(s) written as copies" if aliases else ""
    print(f"wrote {out}: {what}, {len(sd)} tensors, {n:,} elements (parameters and buffers, a tie once){tied} "
          f"(from {src})")
    return 0
