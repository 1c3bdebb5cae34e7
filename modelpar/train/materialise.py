"""Models too big for one rank: build on the meta device, shard, then materialise each rank's shards.

With ``meta_init`` (`TrainConfig`), a Hugging Face model or a built-in GPT preset is built with its
parameters on the meta device (`params_on_meta`: the modules' constructors run, parameters allocate nothing, buffers such as
rotary tables are real and small), laid out by `modelpar.parallel.parallelize` (FSDP and TP shard meta
parameters as they would real ones, into DTensors with meta local shards; a pipeline keeps this rank's
stage modules only), and then `materialise` gives every rank real memory for its own shards of its own
stages only (``to_empty``) and fills them:

- from a local pretrained folder: each shard is read from the ``*.safetensors`` files as a slice
  (``safe_open(...).get_slice``), so no rank ever holds a whole weight it does not own beyond that
  slice;
- from a config: each parameter's values are drawn from a generator seeded by (``seed``, parameter
  name; a tied copy: its tie's first name), one whole parameter at a time on CPU, and this rank's
  slice kept (of the TP-permuted order for GPT-2's fused ``c_attn``). Matrices and embeddings
  ~ N(0, ``initializer_range``) (transformers' default rule; a built-in GPT: its own rule,
  `modelpar.models.gpt.init_std`), norm weights the constant the model's own initialisation gives
  them (1; 0 for Gemma's ``x * (1 + w)`` norms, which start as the identity too), biases 0. The values are the same under every
  layout and world size (the slice of the same full tensor), but they are not the values the model's
  own initialisation draws (which consumes one RNG in construction order), so a ``meta_init`` run is
  comparable to another ``meta_init`` run, not to a run without it.

Peak memory per rank: its shards, plus one whole parameter at a time (the largest: the embedding).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch
import torch.nn as nn


@contextlib.contextmanager
def params_on_meta():
    """Every ``nn.Parameter`` registered inside the block is moved to the meta device as it is
    registered (constructors' own initialisation then runs on meta and costs nothing); buffers stay
    where they are built. A norm's weight (a vector) stays real until the block ends, so the model's
    own initialisation sets it; its value is then recorded on the norm (1, or 0 for Gemma's
    ``x * (1 + w)`` norms: the identity the model starts at) for `materialise`, and it goes to meta too."""
    register = nn.Module.register_parameter
    norms: list[tuple[nn.Module, str]] = []

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            if _is_norm_owner(self) and param.dim() == 1:
                norms.append((self, name))
            else:
                self._parameters[name] = _to_meta(param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for m, name in norms:
            p = m._parameters.get(name)
            if p is None or p.device.type == "meta":
                continue
            first = p.detach().reshape(-1)[:1]
            if p.numel() and bool((p.detach() == first).all()):
                m.__dict__.setdefault("_modelpar_norm_fill", {})[name] = float(first)
            m._parameters[name] = _to_meta(p)


def _to_meta(param: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


def _is_norm_owner(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower()


def meta_buildable(model: str) -> bool:
    """Whether ``meta_init`` can build ``model`` on the meta device: a Hugging Face model or a
    built-in GPT preset (not a factory, whose construction is the user's, nor a built-in MLP / CNN)."""
    from modelpar.models import PRESETS
    from modelpar.models.spec import model_kind

    return model_kind(model) == "hf" or model in PRESETS


def check_meta_init(cfg, plan) -> None:
    """``meta_init`` is for Hugging Face models and the built-in GPT presets (`meta_buildable`) on one
    process, under FSDP, tensor parallelism and pipelines (and their products): layouts whose ranks each
    hold their own shards or stages.

    Raises:
        ValueError: another model kind, placement (one process holds every part), or DDP (it
            broadcasts rank 0's whole parameters at wrap time, which meta parameters do not have).
    """
    if not cfg.meta_init:
        return
    if not meta_buildable(cfg.model):
        raise ValueError(f"--meta-init builds Hugging Face models and the built-in GPT presets on the meta "
                         f"device; --model {cfg.model} is neither (a factory or built-in MLP / CNN builds itself)")
    if plan.is_placement or (plan.dp_replicate > 1 and not plan.fsdp_enabled):
        raise ValueError(f"--meta-init materialises each rank's FSDP / TP shards and pipeline stages; the plan "
                         f"{plan.describe()} has placement or replicas of unsharded parameters (DDP), which need "
                         f"whole parameters at wrap time (use a layout that shards them: --strategy fsdp, hsdp, "
                         f"tp, pp or their products such as fsdp+tp, or single; --strategy auto and rules pick one)")


def _plain_in_place(m: nn.Module, device: torch.device) -> None:
    """Give every plain (not DTensor) meta parameter of ``m`` memory on ``device`` while keeping the
    Parameter object (``torch.utils.swap_tensors``): ``to_empty`` would make new objects for them (meta
    and CPU tensors cannot share ``.data``), and what holds them since the layout was built (the
    gradient-use check, a pipeline's tied-gradient sync) must keep seeing the trained ones."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for p in m.parameters():
        if id(p) in seen or isinstance(p, DTensor) or not p.is_meta:
            continue
        seen.add(id(p))
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") % (2**63 - 1)


def _slices(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """``(local tensor, its slice of the global tensor)`` of a parameter (a DTensor or a plain one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return p, tuple(slice(0, s) for s in p.shape)


def _owners(model: nn.Module) -> dict[str, nn.Module]:
    return {f"{mn}.{pn}" if mn else pn: m for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)}


def _seeded(name: str, owner: nn.Module, shape, seed: int, std: float) -> torch.Tensor:
    if name.endswith("bias"):
        return torch.zeros(shape)
    if _is_norm_owner(owner):       # the model's own constant (1; Gemma's (1 + w) norms: 0), see params_on_meta
        fill = owner.__dict__.get("_modelpar_norm_fill", {}).get(name.rsplit(".", 1)[-1], 1.0)
        return torch.full(shape, fill)
    g = torch.Generator().manual_seed(_seed_of(seed, name))
    return torch.randn(shape, generator=g) * std


def _weight_files(folder: str) -> dict[str, str]:
    """transformers' parameter name -> the ``*.safetensors`` file holding it."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"--meta-init reads weights from safetensors files; {folder!r} has neither "
                         f"model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _std_rule(cfg, m: nn.Module):
    """``name -> std`` of the normal draw of a matrix or embedding: a built-in GPT's own rule
    (`modelpar.models.gpt.init_std`: the residual projections scaled by 1/sqrt(2 n_layer)); a Hugging
    Face model's config's ``initializer_range`` (0.02 where it has none)."""
    from modelpar.models import PRESETS

    if cfg.model in PRESETS:
        from modelpar.models.gpt import init_std

        n_layer = int((cfg.model_config or {}).get("n_layer", PRESETS[cfg.model].n_layer))
        return lambda name: init_std(name, n_layer)
    std = float(getattr(m.hf.config, "initializer_range", 0.02)) if hasattr(m, "hf") else 0.02
    return lambda name: std


@torch.no_grad()
def materialise(modules: list[nn.Module], cfg, device: torch.device,
                ties: list[tuple[str, ...]] | None = None) -> None:
    """Give the meta parameters of ``modules`` (already laid out: FSDP / TP shards, this rank's
    pipeline stages) real memory on ``device`` and fill each rank's shards (see the module docstring).
    Buffers keep their values.

    ``ties``: the whole model's tied parameter groups (`ParallelModel.ties`); every copy of a tie gets
    the values of its first name, so copies on different pipeline stages (GPT-2's ``wte`` on the first,
    ``lm_head`` on the last) start equal, as the one tensor of one process. A fused q|k|v projection
    that TP permuted (`modelpar.parallel.hf_tp.permute_fused_qkv`) gets the permuted columns of the
    canonical full tensor, so its values are those of the same parameter on one process.

    Raises:
        ValueError: a pretrained folder without safetensors weights, or a parameter its files lack.
    """
    from safetensors import safe_open

    from modelpar.parallel.hf_tp import _dim_of, permuted_params
    from modelpar.parallel.ties import find_ties, retie
    from modelpar.train.task import has_weights

    folder = cfg.model if has_weights(cfg.model) else None
    files = _weight_files(folder) if folder else {}
    alias = {n: t for t in (ties or []) for n in t}
    perms = permuted_params(modules)
    handles: dict[str, object] = {}

    def hf(name: str) -> str:
        return name[3:] if name.startswith("hf.") else name

    def source(name: str) -> str:
        """The name whose values ``name`` takes: its tie's first (for a folder, the first it holds)."""
        group = alias.get(name, (name,))
        if folder:
            return next((n for n in group if hf(n) in files), name)
        return group[0]

    for m in modules:
        buffers = {n: b.detach().clone() for n, b in m.named_buffers()}
        tied = find_ties(m)
        _plain_in_place(m, device)
        m.to_empty(device=device)      # the rest (FSDP / TP DTensors keep their objects); a tie ...
        retie([m], tied)               # ... that became two tensors is made one again
        for n, b in m.named_buffers():
            b.copy_(buffers[n])
        owners = _owners(m)
        std_of = _std_rule(cfg, m)
        for name, p in m.named_parameters():
            local, sl = _slices(p)
            src = source(name)
            perm = perms.get(name)
            if folder:
                if hf(src) not in files:
                    raise ValueError(f"--meta-init: {folder!r} has no weight {hf(src)!r}")
                path = files[hf(src)]
                f = handles.get(path) or handles.setdefault(path, safe_open(path, "pt"))
                value = f.get_slice(hf(src))[sl] if perm is None else f.get_tensor(hf(src))
            else:
                value = _seeded(src, owners[name], p.shape, cfg.seed, std_of(src))
                value = value[sl] if perm is None else value
            if perm is not None:       # the laid-out (permuted) order, then this rank's slice
                value = value.index_select(_dim_of(name.rsplit(".", 1)[-1]), perm)[sl]
            local.copy_(value.to(local.dtype))
