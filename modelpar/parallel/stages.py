"""Cutting a model whose glue lives in its own forward (Hugging Face models, most user models).

A Hugging Face causal LM adds position embeddings, builds rotary tables and causal masks and passes
them to every block as keyword arguments, all in the parent's ``forward``; a ViT pools ``[:, 0]``
after its last block. Such a model cannot be run as a chain of its children, so this module keeps the
model's own forward and cuts around it (the "forward" form of `modelpar.parallel.parts`):

Finding the parts (`trace_parts`): the blocks are `parts.find_blocks`' (or ``--blocks PATH``). One
forward on an example micro-batch with hooks on every module records when each module runs. The
input part ("pre") is every outermost module with parameters whose calls all end before the first
block starts; the output part ("post") those whose calls all start after the last block ends (a
module with parameters that never runs goes with the output part). Registration order is not used:
Llama registers ``rotary_emb`` after ``norm`` but runs it before the blocks. Parameter-free modules
(rotary tables, dropout, masks) are glue: they run on every stage. A module with parameters that
runs while the blocks run, or parameters owned directly by a module that holds the blocks, cannot be
placed on one stage: refused by name.

A stage (`build_stage`) is a shell of the whole model: the modules on the paths from the root to the
block container and to the input / output parts are shallow copies (their other children are the
original modules), so state-dict names keep the original paths (``hf.model.layers.5.mlp...``) and
TP plans written in whole-model paths apply per stage. In the shell

- the block container holds only this stage's blocks, keyed by their original indices (iteration
  yields the local ones, ``container[i]`` is block ``i``, slices count original positions);
- on a stage after the first, each input-part module is a parameter-free stub returning the received
  activation (or a zero tensor of the module's traced output shape when that differs, e.g. GPT-2's
  position embedding, ``(1, seq, d)``), so the glue computes masks with the right shape and dtype;
  attribute reads (``embeddings.patch_embeddings.projection.weight.dtype``) go to a skeleton of the
  original module (`skeleton`: its tree and non-tensor attributes, meta tensors for its parameters
  and buffers), so the stage holds none of them (Llama's ``embed_tokens``, GPT-2's ``wpe``: nothing
  trains them there), except a parameter tied to one the stage holds (GPT-2's ``wte.weight`` is the
  last stage's ``lm_head.weight``: the same object, kept tied by `modelpar.parallel.ties`); a read
  that computes with such a meta tensor fails loudly (`check_chain` runs before training). The model's
  forward gets a zero input of the example micro-batch's shape, and a forward-pre-hook on the first
  local block replaces its hidden-state input (the first positional argument) by the received activation;
- on a stage before the last, the output-part modules are absent and a forward hook on the last local
  block ends the forward early (`StageExit`) with the block's output (``output[0]`` for a tuple).

`check_chain` runs every stage in turn on the example and compares with the whole model's forward (to
1e-5 relative), so a model whose glue this does not capture is refused before training, not trained wrongly.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn as nn

from modelpar.parallel.parts import ModelParts, eval_mode

STUB_ATTR = "_modelpar_stub"       # set on stub / absent modules of a stage (TP plans skip them)


class StageExit(Exception):
    """Raised by the last local block's forward hook on a stage before the last; carries its output."""

    def __init__(self, output):
        super().__init__("pipeline stage ends here")
        self.output = output


def _tensor_meta(x):
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


def default_example(model: nn.Module) -> torch.Tensor | None:
    """A one-sample input for tracing a Hugging Face `HFModel` (8 tokens, or one zero image) on the
    model's device; None for other models."""
    from modelpar.models.hf import HFModel, example_input, facts

    if not isinstance(model, HFModel):
        return None
    p = next(model.parameters(), None)
    f = facts(model.hf.config)
    seq = min(8, f.max_positions or 8) if f.task == "lm" else 0
    return example_input(model, 1, seq, device=p.device if p is not None else "cpu")


@torch.no_grad()
def _trace(model: nn.Module, example, block_ids: set[int]):
    """Run ``model(example)``; returns (calls: id -> [[start, end]], first output meta per id, the
    first block's hidden-state input meta, and its type's name)."""
    calls: dict[int, list[list]] = {}
    outs: dict[int, object] = {}
    first_in: list = []
    tick = itertools.count()
    handles = []

    def pre(mod, args, kwargs):
        calls.setdefault(id(mod), []).append([next(tick), None])
        if id(mod) in block_ids and not first_in:
            first_in.append(args[0] if args else kwargs.get("hidden_states"))

    def post(mod, args, out):
        calls[id(mod)][-1][1] = next(tick)
        outs.setdefault(id(mod), _tensor_meta(out))

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post))
    try:
        with eval_mode([model]):
            model(example)
    finally:
        for h in handles:
            h.remove()
    return calls, outs, *((_tensor_meta(first_in[0]), type(first_in[0]).__name__) if first_in else (None, "nothing"))


def trace_parts(model: nn.Module, container: str, blocks: list[tuple[str, nn.Module]], example) -> ModelParts:
    """The "forward" form `ModelParts` of ``model`` (module docstring), from one traced forward.

    Raises:
        ValueError: a block runs more or less than once or out of order, a block gets no tensor as its
            first input, parameters owned by a module holding the blocks, or a module with parameters
            that runs while the blocks run (each named).
    """
    name = type(model).__name__
    block_ids = {id(b) for _, b in blocks}
    calls, outs, hidden, got = _trace(model, example, block_ids)
    seq = [calls.get(id(b), []) for _, b in blocks]
    wrong = [p for (p, _), c in zip(blocks, seq) if len(c) != 1]
    if wrong:
        raise ValueError(f"{name}: pipelines need every block to run exactly once per forward; "
                         f"{wrong[:4]} ran {[len(calls.get(id(dict(blocks)[p]), [])) for p in wrong[:4]]} times")
    starts = [c[0][0] for c in seq]
    if starts != sorted(starts):
        raise ValueError(f"{name}: the blocks of {container} do not run in their order in the container")
    if hidden is None:
        raise ValueError(f"{name}: block {blocks[0][0]} gets a {got} as its first input, not a tensor: a stage cut in "
                         f"the model's own forward hands on one tensor. Make the blocks take and return a tensor, or "
                         f"give the model the sequential form (input part, blocks, output part run in order: dicts "
                         f"and tuples of tensors then cross stages, case C6), or name other blocks with --blocks PATH")
    first, last = seq[0][0][0], seq[-1][0][1]
    prefixes = {""} | {container.rsplit(".", k)[0] for k in range(container.count(".") + 1)} | {container}
    pre, post, bad = [], [], []
    for path, mod in model.named_modules():
        if path in prefixes:
            own = [f"{path}.{n}" if path else n for n, _ in mod.named_parameters(recurse=False)]
            if own:
                raise ValueError(f"{name}: parameters {own[:4]} belong to {path or 'the model itself'}, which "
                                 f"holds the blocks ({container}); a pipeline can place parameters of modules "
                                 f"before or after the blocks only")
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent not in prefixes or id(mod) in block_ids or next(mod.parameters(), None) is None:
            continue                           # inside a part already, a block, or parameter-free glue
        c = calls.get(id(mod), [])
        if not c:
            post.append((float("inf"), path, mod))
        elif all(e is not None and e <= first for _, e in c):
            pre.append((c[0][0], path, mod))
        elif all(s >= last for s, _ in c):
            post.append((c[0][0], path, mod))
        else:
            bad.append(path)
    if bad:
        raise ValueError(f"{name}: {bad[:4]} hold parameters and run while the blocks ({container}) run; a "
                         f"pipeline can place parameters only before the first block or after the last. "
                         f"Name the blocks with --blocks PATH so these modules are inside them")
    pre.sort(key=lambda t: t[0])
    post.sort(key=lambda t: t[0])
    info = {"outs": {p: outs.get(id(m)) for _, p, m in pre}, "hidden": hidden,
            "input": _tensor_meta(example)}
    return ModelParts(form="forward", pre=[(p, m) for _, p, m in pre], blocks=list(blocks),
                      post=[(p, m) for _, p, m in post], container=container, root=model, trace=info)


# ---- the stage shell --------------------------------------------------------------------------------
def _shallow(m: nn.Module) -> nn.Module:
    """A new module object sharing ``m``'s children, parameters and attributes; its own dicts, so
    replacing a child or a hook of the copy leaves ``m`` alone."""
    new = m.__class__.__new__(m.__class__)
    new.__dict__.update(m.__dict__)
    for k, v in m.__dict__.items():
        if k.startswith("_") and isinstance(v, (dict, set)):
            new.__dict__[k] = type(v)(v)
    return new


class _State:
    """What one stage's forward is doing: the received activation, and whether it runs (the hooks on
    its blocks do nothing when the blocks are called otherwise, e.g. by the original model)."""

    def __init__(self):
        self.received = None
        self.active = False


def skeleton(m: nn.Module, keep: dict[int, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``m``'s module tree on the meta device (no memory; ``m`` is left as it is): every module a
    new object sharing the non-tensor attributes, every parameter, buffer and plain tensor attribute a meta
    tensor of its shape, dtype and ``requires_grad`` (tied ones stay tied), except those in ``keep`` (id ->
    the tensor a stage really holds: GPT-2's ``wte.weight`` on the last stage is its ``lm_head.weight``),
    kept as they are. Stage stubs read attributes from it; a factory's meta model is one (`train.task`)."""
    memo: dict[int, object] = dict(keep or {})      # id -> its copy: tensors, and modules (shared stay shared)

    def meta(t):
        if id(t) not in memo:
            e = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else e
        return memo[id(t)]

    def copy(mod: nn.Module) -> nn.Module:
        if id(mod) in memo:
            return memo[id(mod)]
        new = memo[id(mod)] = _shallow(mod)
        new.__dict__["_parameters"] = {k: None if v is None else meta(v) for k, v in mod._parameters.items()}
        new.__dict__["_buffers"] = {k: None if v is None else meta(v) for k, v in mod._buffers.items()}
        new.__dict__["_modules"] = {k: None if v is None else copy(v) for k, v in mod._modules.items()}
        new.__dict__.update({k: meta(v) for k, v in mod.__dict__.items() if isinstance(v, torch.Tensor)})
        return new

    return copy(m)


class _Stub(nn.Module):
    """An input-part module on a stage after the first: returns the received activation (or zeros of
    the traced output shape). Attribute reads fall through to the original module until `release`
    replaces it by its `skeleton` (shapes, dtypes and non-tensor attributes; meta tensors), so the
    stage holds none of its parameters and buffers: nothing trains them there."""

    def __init__(self, state: _State, orig: nn.Module, out_meta, hidden_meta):
        super().__init__()
        self.__dict__["_mp_state"], self.__dict__["_mp_orig"] = state, orig
        self.__dict__["_mp_like"] = None if out_meta == hidden_meta else out_meta
        setattr(self, STUB_ATTR, True)

    def release(self, keep: dict[int, torch.Tensor]) -> None:
        """Drop the reference to the original module (see `skeleton` for ``keep``)."""
        self.__dict__["_mp_orig"] = skeleton(self.__dict__["_mp_orig"], keep)

    def forward(self, *args, **kwargs):
        h = self._mp_state.received
        if self._mp_like is None:
            return h
        shape, dtype = self._mp_like
        return torch.zeros(shape, dtype=dtype, device=h.device)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_mp_orig"], name)


class _Absent(nn.Module):
    """An output-part module on a stage before the last (the forward ends before it runs)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        setattr(self, STUB_ATTR, True)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.path} runs on the last pipeline stage only, but was called before this "
                           f"stage's last block ended")


class _LocalBlocks:
    """Mixin of the block container on a stage: ``[i]`` is block ``i`` of the whole model."""

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            keep = {str(i) for i in range(self._mp_total)[idx]}
            return nn.ModuleList([m for k, m in self._modules.items() if k in keep])
        i = idx + self._mp_total if idx < 0 else idx
        if str(i) not in self._modules:
            raise IndexError(f"block {idx} of {self._mp_path} lives on another pipeline stage")
        return self._modules[str(i)]


class _ForwardStage:
    """Mixin of a stage shell's root: the model's own forward around this stage's blocks."""

    def forward(self, *args, **kwargs):
        info = self._mp_stage
        if not info["is_first"]:
            h = args[0]
            if h.requires_grad:
                from modelpar.parallel.pipeline import _contiguous_grad
                h = _contiguous_grad(h)
            info["state"].received = h
            shape, dtype = info["input"]
            args = (torch.zeros((h.shape[0], *shape[1:]), dtype=dtype, device=h.device),)
        info["state"].active = True
        try:
            out = super().forward(*args, **kwargs)
        except StageExit as e:
            out = e.output
        finally:
            info["state"].received, info["state"].active = None, False
        if info["is_last"]:
            return out
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"pipeline stage {info['index']} ends with a {type(out).__name__}, not a tensor; "
                             f"blocks must return the hidden state (or a tuple starting with it)")
        return out.contiguous()


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[key]


def _inject(state: _State):
    def hook(mod, args, kwargs):
        if not state.active or state.received is None:
            return None
        if args:
            return (state.received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": state.received}
    return hook


def _exit(state: _State):
    def hook(mod, args, out):
        if state.active:
            raise StageExit(out[0] if isinstance(out, (tuple, list)) else out)
    return hook


def build_stage(parts: ModelParts, a: int, b: int, *, index: int, is_first: bool, is_last: bool) -> nn.Module:
    """The shell of the stage holding blocks ``[a, b)`` (module docstring). Its hooks stay on its
    blocks; `release` removes them (for a throw-away stage)."""
    model = parts.root
    if parts.trace is None or (not is_first and parts.trace["input"] is None):
        raise ValueError(f"pipeline stages of {type(model).__name__} are cut inside its own forward, which "
                         f"needs the parts traced on one example input tensor (get_model_parts(..., "
                         f"example_input=...)); a stage after the first feeds the forward a zero input of that shape")
    root = _shallow(model)
    copied: dict[str, nn.Module] = {"": root}

    def parent_of(path: str):
        *heads, leaf = path.split(".")
        cur, cp = root, ""
        for h in heads:
            cp = f"{cp}.{h}" if cp else h
            if cp not in copied:
                copied[cp] = _shallow(cur._modules[h])
                cur._modules[h] = copied[cp]
            cur = copied[cp]
        return cur, leaf

    par, leaf = parent_of(parts.container) if parts.container else (None, "")
    orig = model.get_submodule(parts.container)
    local = _shallow(orig)
    mine = {id(m) for _, m in parts.blocks[a:b]}
    others = {id(m) for _, m in parts.blocks} - mine
    local._modules = {k: m for k, m in orig._modules.items() if id(m) not in others}
    local.__class__ = _mixed(_LocalBlocks, type(orig))
    local.__dict__.update(_mp_total=len(orig), _mp_path=parts.container)
    if par is None:
        raise ValueError("the block container cannot be the model itself in the forward form")
    par._modules[leaf] = copied[parts.container] = local
    state = _State()
    stubs = []
    if not is_first:
        for path, mod in parts.pre:
            p, lf = parent_of(path)
            p._modules[lf] = _Stub(state, mod, parts.trace["outs"].get(path), parts.trace["hidden"])
            stubs.append(p._modules[lf])
    if not is_last:
        for path, _ in parts.post:
            p, lf = parent_of(path)
            p._modules[lf] = _Absent(path)
    held = {id(t): t for t in itertools.chain(root.parameters(), root.buffers())}   # stubs register none
    for stub in stubs:
        stub.release(held)
    handles = []
    if not is_first:
        handles.append(parts.blocks[a][1].register_forward_pre_hook(_inject(state), with_kwargs=True))
    if not is_last:
        handles.append(parts.blocks[b - 1][1].register_forward_hook(_exit(state)))
    root.__class__ = _mixed(_ForwardStage, type(model))
    root.__dict__["_mp_stage"] = {"state": state, "is_first": is_first, "is_last": is_last, "index": index,
                                  "input": parts.trace["input"], "handles": handles}
    return root


def release(stage: nn.Module) -> None:
    """Remove the hooks `build_stage` put on the stage's blocks."""
    for h in stage.__dict__["_mp_stage"]["handles"]:
        h.remove()


@torch.no_grad()
def check_chain(parts: ModelParts, ranges: list[tuple[int, int]], example) -> list:
    """Run the stages of ``ranges`` one after another on ``example`` and compare with the whole model.

    Returns ``[None] * (len(ranges) - 1)`` (a plain tensor crosses every boundary).

    On a model built on the meta device (``meta_init``) there are no values: only the output's shape
    and dtype are compared, so the cut's values are checked by a run of the same model family with
    real weights (a small config under ``modelpar verify``), not here.

    Raises:
        ValueError: a stage's output is not a tensor, a stage's forward fails (`stage_errors.run_stage`), or
            the chained output differs from the model's (largest difference named): the model's forward
            does something a stage cut cannot keep.
    """
    from modelpar.parallel.stage_errors import run_stage

    model, n = parts.root, len(ranges)
    with eval_mode([model]):
        ref = model(example)
        x = example
        for i, (a, b) in enumerate(ranges):
            st = build_stage(parts, a, b, index=i, is_first=i == 0, is_last=i == n - 1)
            x = run_stage(st, x, i, [p for p, _ in parts.blocks[a:b]], model)     # released after
    if not isinstance(ref, torch.Tensor) or not isinstance(x, torch.Tensor) or ref.shape != x.shape:
        raise ValueError(f"{type(model).__name__}: " + (
            f"its forward returns {type(ref).__name__}, not a tensor: a pipeline's last stage hands the loss one "
            f"tensor; wrap the model so its forward returns the logits" if not isinstance(ref, torch.Tensor) else
            f"the pipeline stages chained give {_tensor_meta(x) or type(x).__name__}, the whole forward "
            f"{_tensor_meta(ref) or type(ref).__name__}"))
    if ref.is_meta or x.is_meta:        # a meta-built model (meta_init): shapes and dtypes only
        if ref.dtype != x.dtype:
            raise ValueError(f"{type(model).__name__}: the pipeline stages chained give {x.dtype}, the whole "
                             f"forward {ref.dtype}")
        return [None] * (n - 1)
    diff = (ref.float() - x.float()).abs().max().item()
    if diff > 1e-5 * (1 + ref.float().abs().max().item()):
        raise ValueError(f"{type(model).__name__}: the pipeline stages chained differ from the whole forward by "
                         f"{diff:.3g}: its forward computes something around its blocks ({parts.blocks[0][0]}.."
                         f"{parts.blocks[-1][0]}) that a stage does not carry on, e.g. a residual `h = h + block(h)` "
                         f"in the model's forward; move that into the blocks (the residual inside each block's "
                         f"forward), or name with --blocks PATH blocks that chain to the whole forward (DDP, FSDP, TP need no cut)")
    return [None] * (n - 1)


# ---- costs on one traced forward ----------------------------------------------------------------------
@torch.no_grad()
def part_costs(parts: ModelParts, example, kind: str = "flops", repeats: int = 3):
    """``(pre, block, post)`` costs of the forward form on one example micro-batch, measured inside the
    model's own forward: FLOPs per part from `FlopCounterMode`'s per-module totals plus one per output
    element (as `parts.measure_part_costs`), or the median wall time (s) of each part's call. The
    parameter-free glue runs on every stage and is not counted."""
    from torch.utils.flop_counter import FlopCounterMode

    model = parts.root
    groups = (parts.pre, parts.blocks, parts.post)
    numel: dict[int, int] = {}
    spans: dict[int, list[float]] = {}
    handles = []

    def start(mod, args):
        spans.setdefault(id(mod), []).append(-time.perf_counter())

    def end(mod, args, out):
        spans[id(mod)][-1] += time.perf_counter()
        numel[id(mod)] = sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))

    for group in groups:
        for _, m in group:
            handles.append(m.register_forward_pre_hook(start))
            handles.append(m.register_forward_hook(end))
    try:
        with eval_mode([model]):
            if kind == "flops":
                counter = FlopCounterMode(display=False)
                with counter:
                    model(example)
                flops = counter.get_flop_counts()
                key = type(model).__name__
                return tuple([float(sum(flops.get(f"{key}.{p}", {}).values()) + numel.get(id(m), 0))
                              for p, m in group] for group in groups)
            for _ in range(repeats):
                model(example)
    finally:
        for h in handles:
            h.remove()
    return tuple([sorted(spans.get(id(m), [0.0]))[len(spans.get(id(m), [0.0])) // 2] for _, m in group]
                 for group in groups)


def boundaries_from_split_points(parts: ModelParts, split_points, num_stages: int) -> list[int]:
    """Stage boundaries (block indices) from ``--split-points``: each names the block that starts a stage.

    Raises:
        ValueError: a split point that is not a block path, not increasing, or a count that is not
            ``num_stages - 1``.
    """
    paths = [p for p, _ in parts.blocks]
    bad = [s for s in split_points if s not in paths]
    if bad:
        raise ValueError(f"--split-points {bad} name no block; the blocks are {paths[:3]} .. {paths[-1]} "
                         f"(a split point is the block that starts a stage)")
    idx = [paths.index(s) for s in split_points]
    if len(idx) != num_stages - 1 or idx != sorted(set(idx)) or (idx and idx[0] == 0):
        raise ValueError(f"--split-points {list(split_points)}: {num_stages} pipeline stages need "
                         f"{num_stages - 1} increasing block paths after the first block")
    return idx
