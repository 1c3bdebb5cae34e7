"""Factory models in the forms a user tries first with a Hugging Face model (tests/helpers/hf_factories.py):
``train --strategy auto`` profiles a wrapped HF model as ``plan`` does (`factory_check.factory_profile`)."""

import pytest

pytest.importorskip("transformers")

M = "helpers.hf_factories:"


def test_strategy_auto_picks_a_plan_for_a_factory_wrapped_hf_llama():
    """Before: auto profiled the factory's model moved to the meta device, where Llama's causal mask
    calls .item(), and stopped with "needs the planner's profile ... failed (RuntimeError: Tensor.item()
    cannot be called on meta tensors)"; `plan` (CPU weights under FakeTensorMode) ranked 10 plans."""
    from modelpar.train.config import TrainConfig
    from modelpar.train.resolve import resolve

    cfg = TrainConfig(model=M + "llama", strategy="auto", global_batch_size=4, seq_len=32, hardware="cpu")
    r = resolve(cfg, 2)
    assert r.plan.world_size == 2 and r.reason.startswith("auto: the fastest feasible plan"), r
