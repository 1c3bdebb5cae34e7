"""The main job (`make run` = `modelpar train` with no options): the defaults README's curve is for."""

from __future__ import annotations

import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_run_is_train_with_the_defaults_readme_measures():
    """README's table (880 steps of 16 x 128 bytes, 1.8M tokens, 5e-3 -> 5e-4 after 40 warm-up steps)
    is for the bare command `make run` runs; a change of any of these defaults must move README too."""
    from modelpar.models import PRESETS
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import lr_at

    run = re.search(r"^run:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert run and run.group(1).strip() == "$(VENV)/bin/modelpar train"
    cfg = TrainConfig()
    assert (cfg.model, cfg.strategy, cfg.nproc) == ("gpt-1m", "auto", 2)
    tokens = cfg.steps * cfg.global_batch_size * PRESETS[cfg.model].seq_len
    assert (cfg.steps, cfg.global_batch_size, tokens) == (880, 16, 1_802_240)
    assert (cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.dropout) == (5e-3, 5e-4, 40, 0.0)
    assert math.isclose(lr_at(0, cfg), cfg.lr / cfg.warmup_steps) and math.isclose(lr_at(cfg.warmup_steps, cfg), cfg.lr)
    assert math.isclose(lr_at(cfg.steps - 1, cfg), cfg.min_lr, rel_tol=1e-4)
    readme = (ROOT / "README.md").read_text()
    assert "880 steps of 16 x 128 bytes (1.8M tokens), AdamW 5e-3 after 40 warm-up steps, cosine to 5e-4" in readme
