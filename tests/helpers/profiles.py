"""Planner profiles of the built-in GPT presets, shared by the pure tests (computed once per process).

A GPT's transformer blocks are identical, and so are their profiles (every field but the name), so
`gpt_profile` profiles the preset with 2 blocks on the meta device and repeats the second block: the
same `ModelProfile` as profiling every block (`tests/test_planner_core.py::
test_repeated_block_profile_equals_every_block_profiled` checks that equality on a 6-block model),
in a fraction of the time (gpt-70b: 88 blocks, ~8 s quiet, against ~0.3 s).
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@functools.lru_cache(maxsize=None)
def gpt_profile(name: str, dtype: torch.dtype = torch.float32, batch: int = 1, full: bool = False):
    """(profile, config) of GPT preset ``name`` at its own ``seq_len``, ``batch`` samples, default
    attention and vocabulary-parallel settings (`modelpar.planner.profile.profile_model`).

    ``full=True`` profiles every block (the slow reference); otherwise 2 blocks are profiled and the
    second repeated to the preset's ``n_layer``. The result is frozen and shared: do not rely on
    identity across tests, only on value.

    Raises:
        AssertionError: the two profiled blocks differ (repeating them would then be wrong).
    """
    from modelpar.models import build_model
    from modelpar.models.gpt import PRESETS
    from modelpar.planner.profile import profile_model

    cfg = PRESETS[name]
    layers = cfg.n_layer
    m = build_model(name, device="meta", n_layer=layers if full or layers <= 2 else 2)
    prof = profile_model(m, torch.zeros(batch, cfg.seq_len, dtype=torch.long, device="meta"), dtype=dtype)
    if full or layers <= 2:
        return prof, cfg
    embed, b0, b1, head = prof.blocks
    # block 0 sees no earlier block's saved tensors; block 1 is the steady state every later block is in
    assert dataclasses.replace(b0, name=b1.name) == b1, "GPT blocks profile differently; profile every block"
    blocks = (embed, *(dataclasses.replace(b1, name=f"blocks.{i}") for i in range(layers)), head)
    return dataclasses.replace(prof, blocks=blocks, arch={**prof.arch, "n_layer": layers}), cfg


_PROFILE_FOR: dict = {}


def shared_profile_for(*args):
    """`modelpar.cli.common.profile_for` (``model, model_config, seq_len, precision[, blocks]``), computed
    once per process for each argument list (keyed by ``repr(args)``: the model config is a dict): the
    pure tier asks for the same few profiles in many tests and through the ``plan`` / ``estimate``
    commands (tests/conftest.py's ``shared_profile_for`` fixture). The profile is a frozen dataclass;
    do not rely on identity across tests (a test about object identity calls `profile_for` itself)."""
    from modelpar.cli.common import profile_for

    key = repr(args)
    if key not in _PROFILE_FOR:
        _PROFILE_FOR[key] = profile_for(*args)
    return _PROFILE_FOR[key]
