"""One way to name a model in every command (``--model`` with ``--model-config``).

- A built-in name (`modelpar.models.MODEL_NAMES`): ``gpt-3m``, ``mlp-small``, ``cnn``, ...; for GPT
  presets ``--model-config`` overrides `GPTConfig` fields as a JSON object, e.g.
  ``--model gpt-1b --model-config '{"n_layer": 32, "d_model": 4096, "n_head": 32}'``.
- Your own model as ``module:factory`` (a module importable from the current folder or
  ``PYTHONPATH``) or ``path/to/file.py:factory``.
- A Hugging Face config: ``hf:<model_type>`` with ``--model-config`` overrides, a ``config.json`` path,
  or a local pretrained folder (`modelpar.models.hf`; needs ``pip install 'modelpar[hf]'``).

The factory protocol (the one place it is documented). The factory is called with no arguments, on
every rank and in the launcher, and must build the same initial weights every call (seed inside it).
It returns either

- an ``nn.Module`` taking a float tensor ``(batch, *input_shape)`` and returning class logits
  ``(batch, classes)``: inputs are drawn N(0, 1) and labels uniformly (shapes from ``--input-shape`` /
  ``--num-classes`` where a command has them, or from the first and last ``nn.Linear``), loss =
  cross entropy; or
- a dict with ``model`` and optionally ``batch_fn`` (``step -> (inputs, targets)`` of the whole global
  batch, the same on every rank), ``loss_fn`` (``(output, target) -> scalar``) and ``loss_reduction``
  (``"mean"`` or ``"sum"``); or
- a language model: a dict ``{"model": m, "task": "lm", "vocab_size": V}``, optionally with
  ``"max_positions": P`` (the longest sequence ``m`` takes), where ``m`` maps token ids
  ``(batch, seq)`` int64 to logits ``(batch, seq, V)``. ``modelpar train`` trains it on text like the
  built-in GPT (loss = mean next-token cross entropy, `modelpar.train.task`; tokens: bytes, a
  tokenizer file or a token file, `modelpar.train.tokens`); ``--seq-len`` 0 means ``P``, and a
  sequence longer than ``P`` or a token id >= ``V`` is refused before launch.

Every command runs a factory's model once before launch, on its own weights and a one-sample batch of
its form (`modelpar.models.factory_check.check_forward`): a forward that fails (e.g. token ids into a
model returned bare, taken for a classifier of float inputs; a forward needing more inputs than the
batch's one tensor) or that returns no logits tensor of the form's shape (e.g. a Hugging Face
``ModelOutput``: wrap the model so its forward returns ``.logits``) is refused in one line.

Dropout must be 0 where parity is checked (`modelpar verify`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import torch.nn as nn

from modelpar.models.hf import HF_PREFIX, is_hf_name  # noqa: F401  (HF_PREFIX re-exported)


@dataclass
class UserModel:
    """What a factory returned, normalised. ``batch_fn`` None: derive random batches."""

    model: nn.Module
    batch_fn: object = None
    loss_fn: object = None
    loss_reduction: str = "mean"
    extra: dict = field(default_factory=dict)


def model_kind(name: str) -> str:
    """``"builtin"``, ``"factory"`` or ``"hf"`` for a ``--model`` value.

    Raises:
        ValueError: an unknown built-in name (the valid ones listed).
    """
    from modelpar.models import MODEL_NAMES

    if is_hf_name(name):
        return "hf"
    if ":" in name:
        return "factory"
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}, module:factory / "
                         f"path/to/file.py:factory for your own, or hf:<model_type> / a config.json path / a "
                         f"pretrained folder for a Hugging Face model")
    return "builtin"


def check_model(name: str, model_config: dict | None = None, *, allow_factory: bool = True) -> str:
    """Validate ``--model`` / ``--model-config`` before any work; returns the kind.

    Raises:
        ValueError: unknown name, a Hugging Face config that cannot be built (transformers missing,
            unknown type or fields, custom code), a factory where the command takes built-ins only,
            or ``--model-config`` on a model it cannot apply to (naming the fields).
    """
    kind = model_kind(name)
    if kind == "hf":
        from modelpar.models.hf import load_config, task_of

        if model_config is not None and not isinstance(model_config, dict):
            raise ValueError(f"--model-config must be a JSON object, got {model_config!r}")
        task_of(load_config(name, model_config))
        return kind
    if kind == "factory" and not allow_factory:
        raise ValueError(f"--model {name!r}: this command runs built-in models only (a factory model can be "
                         f"checked with `modelpar verify --model {name}`)")
    if model_config:
        if not isinstance(model_config, dict):
            raise ValueError(f"--model-config must be a JSON object, got {model_config!r}")
        from modelpar.models import PRESETS, GPTConfig

        if name not in PRESETS:
            raise ValueError(f"--model-config overrides the shape of a GPT preset; {name!r} takes none")
        import dataclasses
        valid = [f.name for f in dataclasses.fields(GPTConfig)]
        bad = sorted(set(model_config) - set(valid))
        if bad:
            raise ValueError(f"--model-config has unknown GPT fields {bad}; valid: {', '.join(valid)}")
    return kind


def build_builtin(name: str, model_config: dict | None = None, *, device: str = "cpu", seed: int | None = 0,
                  **overrides) -> nn.Module:
    """A built-in model; ``model_config`` (GPT presets) then ``overrides`` replace preset fields."""
    from modelpar.models import build_model

    check_model(name, model_config, allow_factory=False)
    return build_model(name, device=device, seed=seed, **{**(model_config or {}), **overrides})


def load_factory(name: str):
    """The callable ``module:factory`` or ``path/to/file.py:factory`` names.

    Raises:
        ValueError: the module or file cannot be imported, or has no such attribute.
    """
    mod_name, fn_name = name.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise ImportError(f"no such file {mod_name!r}")
            mod_id = "modelpar_user_" + os.path.splitext(os.path.basename(mod_name))[0]
            spec = importlib.util.spec_from_file_location(mod_id, mod_name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_id] = module
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {name!r}: cannot load {fn_name} from module {mod_name}: {e}") from None


# inside `one_factory_build`: {} or the one build it shares ("name", "built", "modes"); None outside
_SHARED: dict | None = None


@contextlib.contextmanager
def one_factory_build():
    """A scope in which `build_factory` calls a factory once: a later call for the same name gets that
    build (one entry: another name replaces it), its modules back in the train / eval modes the factory
    left them in and its own copy of the declared fields. On exit the build is dropped (and garbage
    collected), so nothing holds the model's memory after. ``modelpar train`` runs its checks before
    launch in one (the forward check, the planner's profile, the meta-device preflight, the pipeline cut
    on real weights), and `modelpar.train.loop.preflight` runs in one. What gets the shared build must
    not change it beyond modes (`modelpar.train.task` copies it to the meta device rather than moving
    it). Nested: the outermost scope holds the build."""
    global _SHARED
    if _SHARED is not None:
        yield
        return
    _SHARED = {}
    try:
        yield
    finally:
        built, _SHARED = bool(_SHARED), None
        if built:               # a model in a reference cycle would otherwise wait for the next collection
            import gc
            gc.collect()


def _shared(um: UserModel) -> UserModel:
    for m, training in _SHARED["modes"]:
        m.training = training
    return dataclasses.replace(um, extra=dict(um.extra))


def build_factory(name: str) -> UserModel:
    """Call the factory and normalise what it returned (see the module docstring); inside
    `one_factory_build`, once per scope for ``name``.

    Raises:
        ValueError: it cannot be loaded, raised (its error and where, in one line), or returned neither
            an ``nn.Module`` nor a dict with one.
    """
    if _SHARED is not None:
        if _SHARED.get("name") == name:
            return _shared(_SHARED["built"])
        _SHARED.clear()         # one entry: the build of another name goes before this one is made
    factory = load_factory(name)
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001 - the user's code: one line, with where it raised
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"--model {name!r}: the factory raised {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]} ({where.filename}, line {where.lineno}, in "
                         f"{where.name})") from None
    spec = made if isinstance(made, dict) else {"model": made}
    model = spec.get("model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name!r}: the factory must return an nn.Module or a dict with 'model', "
                         f"got {type(made).__name__}")
    rest = {k: v for k, v in spec.items() if k not in ("model", "batch_fn", "loss_fn", "loss_reduction")}
    um = UserModel(model, spec.get("batch_fn"), spec.get("loss_fn"), spec.get("loss_reduction", "mean"), rest)
    if _SHARED is None:
        return um
    _SHARED.update(name=name, built=um, modes=[(m, m.training) for m in model.modules()])
    return _shared(um)


def infer_classifier_shapes(model: nn.Module, input_shape: tuple[int, ...] | None = None,
                            num_classes: int = 0) -> tuple[tuple[int, ...], int] | None:
    """(per-sample input shape, classes) of a classifier: the given values, else the first and last
    ``nn.Linear``; None when neither exists."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    shape = input_shape or ((linears[0].in_features,) if linears else None)
    classes = num_classes or (linears[-1].out_features if linears else 0)
    if shape is None or classes < 1:
        return None
    return tuple(shape), classes
