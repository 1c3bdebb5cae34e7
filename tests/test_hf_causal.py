"""A Hugging Face encoder family named as a causal LM (``--model hf:bert``) attends causally: its
causal-LM class attends both ways unless the config says ``is_decoder`` (XLM: ``causal``), which
trained next-token prediction on a model that sees the token it predicts (a new user's report:
validation loss 2.43 against 2.73 for a GPT-2 of the same size, the leak)."""

import pytest
import torch

from helpers.pure_fixtures import requires

pytestmark = requires("transformers")

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 64}


def _leak(name, overrides):
    """max |logit change| at positions 0-9 when token 10 changes (0.0: causal)."""
    from modelpar.models.hf import build_hf

    m = build_hf(name, overrides, dropout=0.0).eval()
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, 10] = (other[0, 10] + 7) % 57 + 3
    with torch.no_grad():
        return float((m(ids)[0, :10] - m(other)[0, :10]).abs().max())


@pytest.mark.parametrize("name,extra", [("hf:bert", {}), ("hf:roberta", {"pad_token_id": 1}), ("hf:electra", {}),
                                        ("hf:bert-generation", {}),
                                        ("hf:xlm", {"emb_dim": 32, "n_layers": 1, "n_heads": 2})])
def test_encoder_families_train_as_causal_lms(name, extra):
    overrides = {k: v for k, v in TINY.items() if name != "hf:xlm" or k == "vocab_size"} | extra
    assert _leak(name, overrides) == 0.0


def test_an_explicit_bidirectional_encoder_is_refused_by_name():
    from modelpar.models.hf import load_config

    with pytest.raises(ValueError, match=r"is_decoder=false makes this bert attend both ways.*drop is_decoder"):
        load_config("hf:bert", {**TINY, "is_decoder": False})
    assert not getattr(load_config("hf:gpt2", {"n_layer": 1}), "is_decoder", False)    # decoders: as they are
