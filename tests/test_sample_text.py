"""The end-of-run text sample (`modelpar.train.runner.sample_text`): built from the gathered state,
the same bytes as one `GPT.generate` call, and cut at a time budget instead of holding a large
model's job for an hour of CPU generation."""

from __future__ import annotations

import torch

from modelpar.models.gpt import build_gpt
from modelpar.train.config import TrainConfig
from modelpar.train.runner import sample_text


def _state():
    return {k: v.clone() for k, v in build_gpt("gpt-nano", seed=3).state_dict().items()}


def test_sample_equals_one_generate_call_and_stops_at_its_budget():
    cfg = TrainConfig(model="gpt-nano", seed=5)
    text, cut = sample_text(cfg, _state(), 12)
    ref = build_gpt("gpt-nano", seed=3)
    want = ref.generate(torch.tensor([list(b"def ")]), 12, generator=torch.Generator().manual_seed(5))
    assert cut is None and text == bytes(want[0].tolist()).decode("utf-8", errors="replace")
    assert text.startswith("def ") and len(text) > 4
    short, cut = sample_text(cfg, _state(), 12, budget_s=0.0)      # every byte ends past the budget
    assert cut is not None and cut.startswith("(sample stopped at 1 of 12 bytes after "), cut
    assert "--sample-bytes 0 skips it" in cut
    assert short.startswith("def ") and len(short) == 5            # the prompt and one byte
