"""Factory models (``--model helpers.hf_factories:NAME``) in the forms a user tries first with a Hugging
Face model, built from configs (never downloaded): ``llama`` (the language-model dict holding a wrapper
whose forward returns ``.logits``: trains), ``llama_raw`` (``LlamaForCausalLM`` returned as it is),
``llama_dict`` (the dict holding the HF model itself: its forward returns ``CausalLMOutputWithPast``),
``bert_cls`` (``BertForSequenceClassification`` as it is) and ``needs_kwargs`` (a forward that needs an
attention mask). All but ``llama`` are refused before launch (`modelpar.models.factory_check`)."""

import torch
import torch.nn as nn

V, P = 256, 64          # byte tokens need a vocabulary of 256


class Logits(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids, use_cache=False).logits


def _lm(m):
    return {"model": m, "task": "lm", "vocab_size": V, "max_positions": P}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=P,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def llama_raw():
    return _llama()


def llama_dict():
    return _lm(_llama())


def llama():
    return _lm(Logits(_llama()))


def bert_cls():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64,
                                                    max_position_embeddings=P, num_labels=3,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class NeedsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, V)

    def forward(self, ids, attention_mask):
        h = self.emb(ids) * attention_mask[..., None]
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def needs_kwargs():
    torch.manual_seed(0)
    return _lm(NeedsMask())
