"""Tiny Hugging Face configs the tests share (built from config, never downloaded).

Each entry: ``--model`` value and ``--model-config`` overrides. Dropout is forced to 0 by the commands
that check parity. Sizes are chosen so TP 2 and PP 2-4 split them: 4 query heads, 2 key/value heads
(GQA) for Llama; 4 layers everywhere.
"""

import json

import pytest

TINY = {
    "llama": ("hf:llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                           "max_position_embeddings": 64}),
    "gpt2": ("hf:gpt2", {"n_embd": 32, "n_layer": 4, "n_head": 4, "vocab_size": 128, "n_positions": 64,
                         "bos_token_id": 0, "eos_token_id": 0}),
    "vit": ("hf:vit", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "image_size": 8, "patch_size": 4, "num_channels": 3,
                       "num_labels": 5}),
}


def cli_args(name: str) -> list[str]:
    """``["--model", spec, "--model-config", json]`` of a tiny config."""
    spec, cfg = TINY[name]
    return ["--model", spec, "--model-config", json.dumps(cfg)]


def build(name: str, **kw):
    """The `HFModel` of a tiny config (skips the test when transformers is not installed)."""
    pytest.importorskip("transformers")
    from modelpar.models.hf import build_hf

    spec, cfg = TINY[name]
    return build_hf(spec, cfg, **kw)
