"""Hugging Face transformers models as modelpar models (``--model hf:<model_type>`` or a config path).

Three spellings, all built from a config with transformers' ``from_config`` (no download, no network):

- ``hf:<model_type>`` (``hf:llama``, ``hf:gpt2``, ``hf:vit``, ...) with ``--model-config '{...}'`` as
  overrides of that type's default config (`transformers.AutoConfig.for_model`);
- a ``config.json`` path (overrides applied on top);
- a local pretrained folder (``config.json`` next to weights): ``load_weights=True`` loads them with
  ``from_pretrained(..., local_files_only=True)``.

Models whose config asks for custom code (``auto_map``, ``trust_remote_code``) are refused: modelpar runs
the model classes that ship with transformers only.

The model is wrapped in `HFModel`, whose forward is ``inputs -> logits`` (a causal LM: token ids
``(batch, seq)`` int64 -> ``(batch, seq, vocab)``; an image classifier: pixels ``(batch, channels, h, w)``
-> ``(batch, classes)``), the contract of every modelpar loop. The wrapped model is ``HFModel.hf``, so
parameter paths gain the prefix ``hf.``; `hf_state_dict` strips it for export.

transformers is an optional extra: ``pip install 'modelpar[hf]'``; `require_transformers` says so.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

HF_PREFIX = "hf:"
INSTALL_HINT = "Hugging Face models need transformers: pip install 'modelpar[hf]' (transformers>=5,<6)"
# config fields that are random-drop probabilities: dropout (``*dropout``, ``*_pdrop``, ``*dropout_prob``,
# ``*dropout_rate``), stochastic depth (Swin's, BEiT's ``drop_path_rate``), drop rates (``attn_drop_rate``,
# ``drop_connect_rate``) and layer drop (``layerdrop``): any float field whose name holds "drop"
# (Swin's default drop_path_rate 0.1 made `verify --strategy ddp` FAIL, 1e-3 at step 2)
_DROP_FIELD = re.compile(r"drop(?!.*value)", re.IGNORECASE)


def is_drop_field(name: str, value) -> bool:
    """Whether config field ``name`` holding ``value`` is a random-drop probability (`_DROP_FIELD`): set
    by ``--dropout``, and not part of the model a checkpoint fits."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(_DROP_FIELD.search(name))


def require_transformers():
    """The transformers module. Raises ValueError with the install line when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return transformers


def is_hf_name(name: str) -> bool:
    """True for ``hf:<type>``, a ``*.json`` config path, or a folder holding ``config.json``."""
    return (name.startswith(HF_PREFIX) or (name.endswith(".json") and ":" not in name)
            or (os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json"))))


@dataclass(frozen=True)
class HFFacts:
    """What legality and the planner need from a config (None where the family has no such field)."""

    model_type: str
    task: str                        # "lm" | "classify"
    hidden: int
    layers: int
    heads: int | None
    kv_heads: int | None
    vocab: int | None                # language models
    max_positions: int | None        # longest sequence the position embeddings / rotary setup allow
    num_labels: int | None           # classifiers
    image_size: int | None
    num_channels: int | None
    tied: bool


def _cfg_get(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def load_config(name: str, overrides: dict | None = None, *, dropout: float | None = None):
    """The transformers config that ``name`` (see the module docstring) and ``overrides`` give.

    ``dropout`` not None sets every dropout probability of the config to it (0.0 for parity checks).

    Raises:
        ValueError: transformers missing, an unknown model type (listing similar ones), an override
            that is not a field of the config, a config path that does not exist, or custom code.
    """
    transformers = require_transformers()
    overrides = dict(overrides or {})
    if name.startswith(HF_PREFIX):
        mtype = name[len(HF_PREFIX):]
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if mtype not in CONFIG_MAPPING_NAMES:
            near = [t for t in CONFIG_MAPPING_NAMES if mtype[:3] and t.startswith(mtype[:3])][:8]
            raise ValueError(f"--model {name!r}: transformers {transformers.__version__} has no model type "
                             f"{mtype!r}" + (f"; similar: {', '.join(near)}" if near else ""))
        base = {}
    else:
        path = name if name.endswith(".json") else os.path.join(name, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model {name!r}: no such config file {path!r}")
        with open(path) as f:
            raw = json.load(f)
        if raw.get("auto_map") or raw.get("trust_remote_code"):
            raise ValueError(f"--model {name!r}: the config asks for custom model code (auto_map / "
                             f"trust_remote_code); modelpar runs only the model classes shipped with transformers")
        if "model_type" not in raw:
            raise ValueError(f"--model {name!r}: {path} has no 'model_type' field")
        mtype = raw.pop("model_type")
        base = {k: v for k, v in raw.items() if not k.startswith("_")}
    default = transformers.AutoConfig.for_model(mtype)
    valid = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as images

    if mtype in images:         # the side of the synthetic images, for a classifier whose config lacks it
        valid.add("image_size")
    bad = sorted(k for k in overrides if k not in valid and not hasattr(default, k))
    if bad:
        raise ValueError(f"--model-config has fields {bad} that {type(default).__name__} does not have; "
                         f"some valid ones: {', '.join(sorted(default.to_dict())[:25])}")
    # overrides go through the constructor, so fields derived from them (Llama's head_dim from
    # hidden_size / num_attention_heads) follow them
    cfg = transformers.AutoConfig.for_model(mtype, **{**base, **overrides})
    _causal_self_attention(cfg, {**base, **overrides}, name)
    if mtype in images and mtype not in _causal_names() and getattr(cfg, "image_size", None) is None:
        raise ValueError(f"--model {name!r}: {type(cfg).__name__} has no image_size (a convolutional classifier "
                         f"takes any); modelpar trains and checks image classifiers on synthetic square images "
                         f"of the config's image_size: give it in --model-config, e.g. '{{\"image_size\": 32}}'")
    if dropout is not None:
        for k, v in cfg.to_dict().items():
            if isinstance(v, float) and is_drop_field(k, v):
                setattr(cfg, k, dropout)
    return cfg


def _causal_self_attention(cfg, given: dict, name: str) -> None:
    """Make a causal-LM config attend causally, as next-token training needs.

    The encoder families transformers maps to a causal-LM class (BERT, RoBERTa, ELECTRA,
    BertGeneration, ...: BertLMHeadModel and the like) attend both ways unless the config sets
    ``is_decoder``, so every position would see the token it must predict (measured: changing token 10
    moves bert's logits at positions 0-9 by 7e-4); XLM reads ``causal`` instead. Every config that
    declares either field gets it set (transformers 5 declares ``is_decoder`` only where a model reads it;
    for the decoders among them, GPT-NeoX, BART's decoder, Pegasus', ..., the logits are identical, checked).

    Raises:
        ValueError: the config (``given``: the file's fields and --model-config) sets either to false.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    for field in ("is_decoder", "causal"):
        if not hasattr(cfg, field):
            continue
        if given.get(field) is False:
            raise ValueError(f"--model {name!r}: {field}=false makes this {cfg.model_type} attend both ways, so "
                             f"each position sees the token it is trained to predict; modelpar trains it as a "
                             f"causal language model with {field}=true (drop {field} from --model-config)")
        setattr(cfg, field, True)


def task_of(cfg) -> str:
    """``"lm"`` when transformers has a causal-LM class for the config, else ``"classify"`` when it has
    an image-classification one.

    Raises:
        ValueError: neither (the model type named).
    """
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)

    if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "lm"
    if cfg.model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "classify"
    raise ValueError(f"model type {cfg.model_type!r}: modelpar trains Hugging Face causal language models "
                     f"(AutoModelForCausalLM) and image classifiers (AutoModelForImageClassification); "
                     f"this type is neither")


# `--seq-len 0` on a Hugging Face language model: min(its max_position_embeddings, this), in every command
# (plan, estimate, bench, train, verify), so `plan` and `train` answer for the same job with the same flags
DEFAULT_SEQ_LEN = 1024


def default_seq_len(max_positions: int | None) -> int:
    """Tokens per sample of a Hugging Face language model run with ``--seq-len 0``: its position limit
    ``max_positions`` (max_position_embeddings / n_positions; None: unknown) capped at `DEFAULT_SEQ_LEN`.
    The one definition every command uses."""
    return min(max_positions or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)


def _last(v):
    return v[-1] if isinstance(v, (list, tuple)) and v else None


def facts(cfg) -> HFFacts:
    """`HFFacts` of a transformers config. A convolutional classifier (ResNet, ConvNeXt: ``hidden_sizes``
    and ``depths`` per stage, no ``hidden_size``) gets its last stage's width and its blocks in all;
    a config with one head count per stage (Swin) gets their greatest common divisor (a TP degree must
    divide every stage's)."""
    task = task_of(cfg)
    heads = _cfg_get(cfg, "num_attention_heads", "n_head")
    if isinstance(heads, (list, tuple)):        # Swin: one count per stage; every stage must split alike
        heads = math.gcd(*heads) if heads else None
    image = _cfg_get(cfg, "image_size")
    return HFFacts(
        model_type=cfg.model_type, task=task,
        hidden=int(_cfg_get(cfg, "hidden_size", "n_embd", "d_model") or _last(_cfg_get(cfg, "hidden_sizes")) or 0),
        layers=int(_cfg_get(cfg, "num_hidden_layers", "n_layer") or sum(_cfg_get(cfg, "depths") or [0])),
        heads=heads, kv_heads=_cfg_get(cfg, "num_key_value_heads") or heads,
        vocab=_cfg_get(cfg, "vocab_size") if task == "lm" else None,
        max_positions=_cfg_get(cfg, "max_position_embeddings", "n_positions") if task == "lm" else None,
        num_labels=cfg.num_labels if task == "classify" else None,
        image_size=int(image if isinstance(image, int) else image[0]) if image is not None else None,
        num_channels=_cfg_get(cfg, "num_channels"),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)) and task == "lm")


class HFModel(nn.Module):
    """A transformers model with modelpar's forward: ``inputs -> logits`` tensor.

    ``task="lm"``: ``input_ids (batch, seq)`` int64 -> logits ``(batch, seq, vocab)``, no KV cache.
    ``task="classify"``: ``pixel_values (batch, channels, h, w)`` -> logits ``(batch, num_labels)``.
    """

    def __init__(self, hf: nn.Module, task: str):
        super().__init__()
        self.hf = hf
        self.task = task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task == "lm":
            if _no_values(x):
                with _unpacked_sequences():
                    return self.hf(input_ids=x, use_cache=False).logits
            return self.hf(input_ids=x, use_cache=False).logits
        return self.hf(pixel_values=x).logits


def _no_values(x: torch.Tensor) -> bool:
    """A meta or fake tensor (planning, shape inference): its values cannot be read."""
    from torch._subclasses.fake_tensor import FakeTensor
    return x.device.type == "meta" or isinstance(x, FakeTensor)


class _unpacked_sequences:
    """Context: transformers' check for packed sequences in the position ids (which reads their
    values, impossible on meta, and is skipped on fake tensors, so a mask is built) answers "one
    sequence per sample", which is what modelpar's token batches are; so the model runs as it runs
    on real tokens (causal attention without a mask tensor).

    Two more reads of values a meta forward cannot do answer as for modelpar's real batches (no padding,
    no attention mask): ``masking_utils.fast_all`` of a padding mask the model builds itself
    (`_all_true_without_values`) and the padding warning of BERT-like models (`_no_padding_warning`).

    And the grouped product of a mixture of experts (Mixtral, Qwen2-MoE, ...: transformers'
    ``integrations.moe._grouped_mm``) runs as `_meta_grouped_mm`: torch's meta kernel of ``grouped_mm``
    takes bf16 only (an fp32 profile stopped with a traceback) and FLOP counters have no formula for it
    (the experts' FLOPs counted 0)."""

    def __enter__(self):
        import transformers.masking_utils as mu
        from transformers.modeling_utils import PreTrainedModel

        self.saved = []
        self._swap(mu, "find_packed_sequence_indices", lambda old: lambda position_ids: None)
        self._swap(mu, "fast_all", _all_true_without_values)
        self._swap(PreTrainedModel, "warn_if_padding_and_no_attention_mask", _no_padding_warning)
        try:
            import transformers.integrations.moe as moe
        except ImportError:
            moe = None
        self._swap(moe, "_grouped_mm", lambda old: _meta_grouped_mm)

    def _swap(self, owner, name: str, make) -> None:
        """``owner.name = make(owner.name)`` where ``owner`` has it (transformers versions differ)."""
        old = getattr(owner, name, None) if owner is not None else None
        if old is not None:
            self.saved.append((owner, name, old))
            setattr(owner, name, make(old))

    def __exit__(self, *exc):
        for owner, name, old in reversed(self.saved):
            setattr(owner, name, old)


def _all_true_without_values(fast_all):
    """transformers' ``masking_utils.fast_all(mask)`` (``mask.sum() == mask.numel()``, read as a Python
    bool), answering True for a mask without values (`_no_values`): modelpar passes no attention mask, so
    a padding mask the model builds itself (BART's, BioGPT's, Pegasus' ``torch.ones(batch, seq)`` when none
    is given) is all ones, and ``bool()`` of a meta tensor stopped every meta profile of those families
    ('Tensor.item() cannot be called on meta tensors'). ``mask``: ``(batch, kv_len)`` bool / float."""

    def all_true(mask: torch.Tensor):
        return True if _no_values(mask) else fast_all(mask)

    return all_true


def _no_padding_warning(warn):
    """``PreTrainedModel.warn_if_padding_and_no_attention_mask(input_ids (batch, seq), mask)``, skipped on
    token ids without values: it only warns, and its ``pad_token_id in input_ids[:, [-1, 0]]`` stopped the
    meta profile of BigBird, MegatronBERT, RemBERT, RoFormer ('Tensor.item() cannot be called on meta
    tensors')."""

    def check(self, input_ids, attention_mask):
        if input_ids is not None and _no_values(input_ids):
            return None
        return warn(self, input_ids, attention_mask)

    return check


def _meta_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """``input (rows, k) x grouped weight (experts, k, n) -> (rows, n)`` without values: one matmul of the
    same rows by one expert's ``(k, n)``, so the output, the FLOPs (2 rows k n forward, twice that
    backward) and the saved input are those of the grouped product, whatever the split ``offs``."""
    return input.to(weight.dtype) @ weight[0]


def build_hf(name: str, overrides: dict | None = None, *, device: str | torch.device = "cpu", seed: int | None = 0,
             dropout: float | None = None, load_weights: bool = False) -> HFModel:
    """Build the `HFModel` of ``name``.

    ``device="meta"`` allocates nothing (planning). ``seed`` seeds the initialisation, so every rank
    builds the same weights. ``load_weights``: ``name`` is a local pretrained folder; its weights are
    loaded (``local_files_only``).

    Raises:
        ValueError: see `load_config` and `task_of`; a config transformers cannot build its model from
            (the model type, the error and the --model-config to check named).
    """
    transformers = require_transformers()
    cfg = load_config(name, overrides, dropout=dropout)
    task = task_of(cfg)
    auto = transformers.AutoModelForCausalLM if task == "lm" else transformers.AutoModelForImageClassification
    if load_weights:
        if os.path.isfile(name) or name.startswith(HF_PREFIX):
            raise ValueError(f"--model {name!r}: loading weights needs a local pretrained folder")
        hf = auto.from_pretrained(name, config=cfg, local_files_only=True, trust_remote_code=False)
        return HFModel(hf.to(device), task)
    _pick_architecture(cfg, task)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            hf = auto.from_config(cfg)
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        # an inconsistent config (ConvNeXt's depths of 2 stages with num_stages 4: IndexError deep in its
        # __init__) is the user's --model-config, said in one line before launch, not a traceback
        raise ValueError(f"--model {name!r}: transformers could not build {auto.__name__} of model type "
                         f"{cfg.model_type!r} from this config ({type(e).__name__}: {e}); check --model-config "
                         f"(fields that must agree, e.g. per-layer or per-stage lists and their counts)") from e
    return HFModel(hf, task)


def _causal_names():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _pick_architecture(cfg, task: str) -> None:
    """A type transformers maps to several classes of the task (DeiT, LeViT: the classifier and the one
    ``WithTeacher``) is resolved by ``config.architectures``; a config built from its type has none, and
    ``from_config`` raised ``TypeError: 'NoneType' object is not iterable``. The first class (the plain
    one) is named in the config then."""
    from transformers.models.auto import modeling_auto as ma

    names = (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if task == "lm" else ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
    cls = names.get(cfg.model_type)
    if isinstance(cls, (tuple, list)) and not getattr(cfg, "architectures", None):
        cfg.architectures = [cls[0]]


def example_input(model: HFModel, batch: int, seq_len: int = 0, device="cpu") -> torch.Tensor:
    """A zero input of ``batch`` samples: token ids ``(batch, seq_len)`` or pixels ``(batch, c, h, w)``.

    Raises:
        ValueError: a language model without ``seq_len``.
    """
    f = facts(model.hf.config)
    if f.task == "lm":
        if seq_len < 1:
            raise ValueError("a Hugging Face language model needs --seq-len")
        return torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    return torch.zeros(batch, f.num_channels or 3, f.image_size, f.image_size, device=device)


def hf_state_dict(model: HFModel | nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A modelpar state dict of an `HFModel` with transformers' own key names (the ``hf.`` prefix off)."""
    return {k[3:] if k.startswith("hf.") else k: v for k, v in state.items()}
