"""A factory model (``module:factory``, `modelpar.models.spec`) as every command sees it before launch:
its one-sample example input, one forward on it (`check_forward`: a model of a form modelpar cannot
train is refused in one line naming the form it needs), and its planner profile (`factory_profile`:
the one function ``plan``, ``estimate`` and ``train --strategy auto`` profile it with).

Why one forward: the forms a user tries first with a Hugging Face model (``LlamaForCausalLM`` returned
as it is, or in the language-model dict; a forward that needs an attention mask) otherwise launch the
ranks and fail in each with a traceback, or make ``plan`` rank plans for a model ``train`` cannot run.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

DOC = "docs/your-model.md"


def factory_lm_seq_len(model: str, extra: dict, seq_len: int) -> int:
    """Tokens per sample of a factory language model (``{"model", "task": "lm", "vocab_size",
    "max_positions"}``, `modelpar.models.spec`): ``seq_len``, or (0) its ``max_positions``, as train's.

    Raises:
        ValueError: neither given, or ``seq_len`` beyond ``max_positions`` (naming both).
    """
    maxpos = extra.get("max_positions")
    if seq_len < 0:
        raise ValueError(f"--seq-len must be >= 0, got {seq_len}")
    if seq_len and isinstance(maxpos, int) and seq_len > maxpos:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_positions={maxpos} that --model {model!r} declares")
    seq = seq_len or (maxpos if isinstance(maxpos, int) else 0)
    if seq < 1:
        raise ValueError(f"--model {model!r}: a factory language model without 'max_positions' needs --seq-len")
    return seq


def factory_input(name: str, um, seq_len: int) -> torch.Tensor:
    """The one-sample input of a factory model (`spec.UserModel`): its ``batch_fn``'s first sample,
    zero token ids of a language model, or zeros of a classifier's input shape.

    Raises:
        ValueError: a classifier whose input shape is neither declared nor inferable.
    """
    from modelpar.models.spec import infer_classifier_shapes

    if um.batch_fn is not None:
        return um.batch_fn(0)[0][:1]
    if um.extra.get("task") == "lm":
        return torch.zeros(1, factory_lm_seq_len(name, um.extra, seq_len), dtype=torch.long)
    shape = um.extra.get("input_shape")
    shapes = infer_classifier_shapes(um.model, tuple(shape) if shape else None, um.extra.get("num_classes", 0))
    if shapes is None:
        raise ValueError(f"--model {name!r}: cannot tell its input shape (no nn.Linear); return "
                         f"{{'model': m, 'task': 'classify', 'input_shape': [...], 'num_classes': K}} "
                         f"or a 'batch_fn' from the factory")
    return torch.zeros(1, *shapes[0])


def form_of(um) -> str:
    """``"custom"`` (its own batch_fn / loss_fn), ``"lm"``, or ``"classify"`` (declared or not)."""
    if um.batch_fn is not None or um.loss_fn is not None:
        return "custom"
    return "lm" if um.extra.get("task") == "lm" else "classify"


def _first_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module (in definition order) holding parameters of its own."""
    return next(((n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))), None)


def _required_inputs(model: nn.Module) -> list[str]:
    """The names of the forward's positional parameters without a default."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def _shape(x) -> str:
    return f"({', '.join(str(d) for d in x.shape)}) {str(x.dtype).replace('torch.', '')}"


def check_forward(name: str, model: nn.Module, x: torch.Tensor, *, form: str, vocab: int = 0,
                  classes: int = 0) -> None:
    """One forward of ``model`` (real weights, no grad) on the one-sample example ``x`` of its form
    (``"lm"``: token ids to logits ``(batch, seq, vocab)``; ``"classify"``: float inputs to logits
    ``(batch, classes)``; ``"custom"``: the factory's own batch_fn / loss_fn, whose output its loss
    takes as it is). ``vocab``: a language model's declared vocabulary, ``classes``: a classifier's
    classes, the labels the data draws (0: unchecked). Logits wider than either are accepted (a
    vocabulary padded to a multiple of 64, as many models pad theirs); narrower ones are refused, as
    the labels would index past them.

    Raises:
        ValueError: one line: the forward fails (naming the error and the form it needs), or a model
            of the lm / classify form returns something other than a logits tensor of that shape.
    """
    what = f"--model {name!r}: the model's forward"
    modes = [(m, m.training) for m in model.modules()]
    try:                        # eval: a batch of one passes batch norm, and no running statistic moves
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:      # noqa: BLE001 - any failure is the user's model: one line, the way out
        err = f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"
        first = _first_layer(model)
        if isinstance(e, TypeError) and len(_required_inputs(model)) > 1:
            raise ValueError(f"{what} needs more inputs than the batch gives it ({err}): modelpar calls it with "
                             f"one tensor, the batch's inputs {_shape(x)}; wrap the model so its forward takes "
                             f"only that and builds the rest itself (e.g. an all-ones attention mask) ({DOC})") from None
        if (first is not None and isinstance(first[1], nn.Embedding) and x.is_floating_point()
                and form == "classify"):
            raise ValueError(f"{what} fails ({err}): its first layer {first[0] or type(model).__name__} is an "
                             f"embedding that needs integer token ids, but a factory that returns a module (or "
                             f"'task': 'classify') is a classifier of float inputs: for a language model return "
                             f"{{'model': m, 'task': 'lm', 'vocab_size': V}} whose forward maps token ids to "
                             f"logits (batch, seq, V) ({DOC})") from None
        if form == "classify" and first is not None and not isinstance(first[1], nn.Linear) and x.dim() == 2:
            raise ValueError(f"{what} fails on a batch of {_shape(x)} ({err}): unless declared, a classifier's input "
                             f"shape is read from its first nn.Linear, but its first layer {first[0]} is a "
                             f"{type(first[1]).__name__}; declare the shape: return {{'model': m, 'task': 'classify', "
                             f"'input_shape': [...], 'num_classes': K}} ({DOC})") from None
        if form == "lm" and isinstance(e, IndexError):       # an embedding indexed past its end
            raise ValueError(f"{what} fails on a batch of {_shape(x)} ({err}): one of its embeddings is shorter than "
                             f"the ids it got, likely a position table shorter than the sequence {x.shape[1]} "
                             f"(declare the model's own max_positions, or pass a shorter --seq-len) ({DOC})") from None
        raise ValueError(f"{what} fails on a batch of {_shape(x)} ({err}); it must map the "
                         f"{'token ids' if form == 'lm' else 'inputs'} of one batch to logits ({DOC})") from None
    finally:
        for m, training in modes:
            m.training = training
    if form == "custom":
        return
    if not isinstance(out, torch.Tensor):
        logits = getattr(out, "logits", None)
        how = (f"wrap it so forward returns .logits (e.g. `return self.hf(input_ids=ids, use_cache=False).logits`)"
               if isinstance(logits, torch.Tensor) else "wrap it so forward returns the logits tensor")
        raise ValueError(f"{what} returns {type(out).__name__}, not a tensor: {how} ({DOC})")
    if form == "lm":
        if out.dim() != 3 or tuple(out.shape[:2]) != tuple(x.shape) or (vocab and out.shape[-1] < vocab):
            raise ValueError(f"{what} returns a tensor of shape {tuple(out.shape)} for token ids of shape "
                             f"{tuple(x.shape)}: a language model returns logits (batch, seq, vocab_size"
                             f"{'=' + str(vocab) if vocab else ''}) ({DOC})")
    elif out.dim() != 2 or out.shape[0] != x.shape[0] or (classes and out.shape[1] < classes):
        raise ValueError(f"{what} returns a tensor of shape {tuple(out.shape)} for inputs of shape {tuple(x.shape)}: "
                         f"a classifier returns logits (batch, classes{'=' + str(classes) if classes else ''}); "
                         f"{'declare the num_classes its output has, or ' if classes else ''}"
                         f"fix its output ({DOC})")


def check_factory(name: str, um, seq_len: int) -> torch.Tensor:
    """`check_forward` of a built factory model (`spec.UserModel`) on its `factory_input`; returns the
    input."""
    x = factory_input(name, um, seq_len)
    vocab, classes = um.extra.get("vocab_size"), um.extra.get("num_classes")
    check_forward(name, um.model, x, form=form_of(um), vocab=vocab if isinstance(vocab, int) else 0,
                  classes=classes if isinstance(classes, int) and form_of(um) == "classify" else 0)
    return x


def factory_profile(name: str, seq_len: int, dtype: torch.dtype, blocks: str = ""):
    """``(profile, description)`` of a factory model: built on CPU (its own weights; inside
    `modelpar.models.spec.one_factory_build`, the scope's one build), checked (`check_factory`), profiled
    on its one-sample input (`planner.profile.profile_model`, under FakeTensorMode) with the pipeline cut
    made on its weights (`parallel.cut.with_pipeline_refusal`).
    ``plan``, ``estimate`` and ``train --strategy auto`` all profile a factory model here.

    Raises:
        ValueError: see `factory_input` and `check_forward`.
    """
    from modelpar.models.spec import build_factory
    from modelpar.parallel.cut import with_pipeline_refusal
    from modelpar.planner.profile import default_blocks, profile_model

    um = build_factory(name)
    x = check_factory(name, um, seq_len)
    prof = profile_model(um.model, x, dtype=dtype, blocks=default_blocks(um.model, blocks or None),
                         autocast=dtype == torch.bfloat16)
    from modelpar.parallel.tp_factory import with_tp_refusal

    prof = with_tp_refusal(with_pipeline_refusal(prof, um.model, x, blocks), um.model, x)
    return prof, f"{type(um.model).__name__} from {name}"
