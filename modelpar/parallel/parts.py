"""Which models modelpar can split, and how: the three "any model" forms.

1. ``nn.Sequential``: every child is a block ("sequential").
2. A module whose direct children are an input part, one ``nn.ModuleList`` of blocks, and an output
   part, whose forward is those children run in order (like the built-in GPT: ``embed``, ``blocks``,
   ``head``; "modulelist").
3. Any other module ("forward"): the blocks are found anywhere in the tree (`find_blocks`, or
   ``--blocks PATH``), the input and output parts by tracing one forward, and every pipeline stage
   runs the model's own forward around its blocks (`modelpar.parallel.stages`), so glue in the
   parent's forward (position embeddings, rotary tables, masks, pooling) is kept. Hugging Face
   models take this form. ``--split-points`` names the blocks that start a stage.

Everything that cuts a model (pipeline stages, layer placement, per-block FSDP and activation
checkpointing, stage balancing) works on the `ModelParts` of a model, so the forms are handled here
once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from modelpar.stage_split import balanced_partition  # noqa: F401  (re-exported: placement, tests)

FORMS_HELP = ("modelpar splits a model at its repeated blocks: the longest run of modules of one class in "
              "an nn.ModuleList or nn.Sequential anywhere in the model (an nn.Sequential model: its children), "
              "or the container named by --blocks PATH; --split-points A,B names the blocks that start a "
              "pipeline stage")


@dataclass
class ModelParts:
    """A model seen as ``pre`` -> ``blocks`` -> ``post``; each entry is (module path, module)."""

    form: str                                    # "sequential" | "modulelist" | "forward" | "whole"
    pre: list[tuple[str, nn.Module]] = field(default_factory=list)
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)
    post: list[tuple[str, nn.Module]] = field(default_factory=list)
    container: str = ""                          # "forward": path of the block container
    root: nn.Module | None = field(default=None, repr=False)   # "forward": the model
    trace: dict | None = field(default=None, repr=False)       # "forward": shapes seen when traced

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def all(self) -> list[tuple[str, nn.Module]]:
        return self.pre + self.blocks + self.post


def split_points_of(text: str | None) -> tuple[str, ...] | None:
    """``--split-points A,B`` as a tuple of block paths (None when empty)."""
    pts = tuple(p.strip() for p in (text or "").split(",") if p.strip())
    return pts or None


def get_model_parts(model: nn.Module, split_points=None, *, blocks: str | None = None,
                    example_input=None) -> ModelParts:
    """Find the parts of ``model`` (module docstring).

    Args:
        split_points: block paths that start a pipeline stage; checked here against the blocks (the
            boundaries themselves are `stages.boundaries_from_split_points`).
        blocks: the block container's path (``--blocks``); None: `find_blocks`' rule.
        example_input: one micro-batch; the "forward" form traces it to find the input and output parts
            (a Hugging Face model makes its own). Without one, modules registered before the blocks'
            branch count as the input part and after it as the output part (enough for counting blocks
            and checking ties before launch; pipelines always trace).

    Raises:
        ValueError: no blocks (naming --blocks / --split-points), a split point that names no block, or a
            model whose forward cannot be cut (see `stages.trace_parts`).
    """
    parts = _find_parts(model, blocks, example_input)
    if split_points:
        paths = {p for p, _ in parts.blocks}
        bad = [p for p in split_points if p not in paths]
        if bad:
            raise ValueError(f"--split-points {bad} name no block of {type(model).__name__}; its blocks are "
                             f"{parts.blocks[0][0]} .. {parts.blocks[-1][0]}")
    return parts


def _find_parts(model, blocks, example_input) -> ModelParts:
    if blocks is None and isinstance(model, nn.Sequential):
        return ModelParts(form="sequential", blocks=list(model.named_children()))
    children = list(model.named_children())
    lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList)]
    if blocks in (None, children[lists[0]][0] if len(lists) == 1 else None) and len(lists) == 1:
        i = lists[0]
        name, ml = children[i]
        if len(ml) == 0:
            raise ValueError(f"{type(model).__name__}.{name} is an empty nn.ModuleList. {FORMS_HELP}")
        parts = ModelParts(form="modulelist", pre=children[:i],
                           blocks=[(f"{name}.{j}", b) for j, b in enumerate(ml)], post=children[i + 1:])
        if example_input is None or _chain_matches(model, parts, example_input):
            return parts
    container, found = find_blocks(model, blocks)
    from modelpar.parallel import stages

    if example_input is not None:
        return stages.trace_parts(model, container, found, example_input)
    ex = stages.default_example(model)
    if ex is not None and ex.device.type != "meta":     # transformers' masks read values: not on meta
        return stages.trace_parts(model, container, found, ex)
    return _registration_parts(model, container, found)


def _chain_matches(model, parts, example_input) -> bool:
    """Whether the ModuleList form runs as the model does (a probe: running the children in order may
    feed a block what the model never would, so what it warns about is not the user's code's doing)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_parts_order(model, parts, example_input)
    except (ValueError, RuntimeError, TypeError, IndexError, KeyError):
        return False
    return True


def _registration_parts(model, container, found) -> ModelParts:
    """Input / output parts by registration order around the blocks' branch (no trace)."""
    ids = {id(m) for _, m in found}
    pre, post = [], []
    prefix, mod = "", model
    for seg in container.split(".") if container else []:
        after, level = False, []
        for n, c in mod.named_children():
            if n == seg:
                after = True
                continue
            if next(c.parameters(), None) is not None and id(c) not in ids:
                (level if after else pre).append((prefix + n, c))
        post = level + post                      # an inner level's output part runs before the outer's
        prefix, mod = f"{prefix}{seg}.", mod._modules[seg]
    return ModelParts(form="forward", pre=pre, blocks=list(found), post=post, container=container, root=model)


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The repeated blocks of any model: ``(container path, [(block path, block), ...])``.

    The rule: among every ``nn.ModuleList`` / ``nn.Sequential`` anywhere in the tree, take the longest
    run of consecutive children of one class (ties: the shallower container, then the first met). So
    ``model.layers`` (Llama), ``transformer.h`` (GPT-2), ``vit.encoder.layer`` (ViT) and a ResNet
    stage's blocks are found without naming them. ``blocks`` names the container instead, where the
    rule picks wrong.

    Raises:
        ValueError: ``blocks`` names no container of the model, or no container holds two or more
            modules of one class.
    """
    named = dict(model.named_modules())
    if blocks:
        c = named.get(blocks)
        if not isinstance(c, (nn.ModuleList, nn.Sequential)) or len(c) == 0:
            containers = [n for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.Sequential)) and n]
            raise ValueError(f"--blocks {blocks!r} is not a non-empty nn.ModuleList / nn.Sequential of "
                             f"{type(model).__name__}; its containers: {containers[:10]}")
        pre = f"{blocks}." if blocks else ""
        return blocks, [(pre + n, m) for n, m in c.named_children()]
    runs = []                                             # (length, -depth, order), path, run
    for order, (path, c) in enumerate(named.items()):
        if not isinstance(c, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(c.named_children())
        i = 0
        while i < len(kids):
            j = i
            while j + 1 < len(kids) and type(kids[j + 1][1]) is type(kids[i][1]):
                j += 1
            run = kids[i:j + 1]
            if len(run) >= 2:
                runs.append(((len(run), -path.count(".") - bool(path), -order), path, run))
            i = j + 1
    best = max((r for r in runs if not _inside_every_block(r[1], runs, named)), key=lambda r: r[0], default=None)
    if best is None:
        raise ValueError(f"cannot find the blocks of {type(model).__name__}: no nn.ModuleList or nn.Sequential "
                         f"in it holds a run of two or more consecutive modules of one class. Pipelines, layer placement, activation "
                         f"checkpointing and per-block FSDP cut a model at its blocks: put the layers in an "
                         f"nn.ModuleList (or nn.Sequential) and name it with --blocks PATH if the rule picks "
                         f"another one; --split-points A,B then names the blocks that start each stage")
    _, path, run = best
    pre = f"{path}." if path else ""
    return path, [(pre + n, m) for n, m in run]


def _inside_every_block(path: str, runs: list, named: dict) -> bool:
    """True when container ``path`` sits at the same place inside every block of another run, with as
    many children in each (StableLM's per-head ``self_attn.q_layernorm.norms`` in every decoder layer):
    it is part of the blocks' structure, not the blocks, even when longer (4 heads over 2 layers picked
    the norms: pipelines, FSDP units and TP derivation then cut the model at one layer's norms)."""
    n = len(named[path])
    for _, outer, run in runs:
        pre = f"{outer}." if outer else ""
        for name, _ in run:
            if path.startswith(f"{pre}{name}."):
                rel = path[len(pre + name) + 1:]
                if all(isinstance(named.get(f"{pre}{b}.{rel}"), (nn.ModuleList, nn.Sequential))
                       and len(named[f"{pre}{b}.{rel}"]) == n for b, _ in run):
                    return True
    return False


class eval_mode:
    """Context: the given modules in eval mode (dropout off, so dry runs draw no random numbers and
    leave the RNG state as they found it), restored after."""

    def __init__(self, modules):
        self.modules = [m for _, m in modules] if modules and isinstance(modules[0], tuple) else list(modules)

    def __enter__(self):
        self.was = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()

    def __exit__(self, *exc):
        for m, w in zip(self.modules, self.was):
            m.train(w)


def run_parts(parts: ModelParts, x):
    """Run pre -> blocks -> post in order (the contract of forms 1 and 2)."""
    for _, m in parts.all():
        x = m(x)
    return x


@torch.no_grad()
def check_parts_order(model: nn.Module, parts: ModelParts, example_input: torch.Tensor) -> None:
    """Check that running the parts in order reproduces ``model(example_input)``.

    Pipelines run the parts one after another; a model whose forward does something else (skips a
    child, reorders, adds a residual around the list) would be silently wrong, so it is refused.

    Raises:
        ValueError: the outputs differ (with the largest difference) or have different shapes.
    """
    if parts.form not in ("sequential", "modulelist"):
        return                                   # the forward form: `stages.check_chain`
    was_training = model.training
    model.eval()
    try:
        ref, got = model(example_input), run_parts(parts, example_input)
    finally:
        model.train(was_training)
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor) or ref.shape != got.shape:
        raise ValueError(f"{type(model).__name__}.forward is not its children run in order (output "
                         f"shapes differ). {FORMS_HELP}")
    diff = (ref - got).abs().max().item()
    if diff > 1e-5 * (1 + ref.abs().max().item()):
        raise ValueError(f"{type(model).__name__}.forward is not its children run in order (largest "
                         f"output difference {diff:.3g}). {FORMS_HELP}")


def block_param_costs(parts: ModelParts) -> list[float]:
    """Parameter count per block, with the input part added to the first block and the output part to
    the last (they live on the first and last stage)."""
    costs = [float(sum(p.numel() for p in m.parameters())) for _, m in parts.blocks]
    costs[0] += sum(p.numel() for _, m in parts.pre for p in m.parameters())
    costs[-1] += sum(p.numel() for _, m in parts.post for p in m.parameters())
    return [max(c, 1.0) for c in costs]


def stage_ranges(num_blocks: int, boundaries: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) block ranges from the start index of every stage after the first."""
    starts = [0] + list(boundaries)
    ends = list(boundaries) + [num_blocks]
    return list(zip(starts, ends))


@torch.no_grad()
def measure_part_costs(parts: ModelParts, example_input: torch.Tensor, *, kind: str = "flops",
                       repeats: int = 3) -> tuple[list[float], list[float], list[float]]:
    """Cost of every part on one example micro-batch: ``(pre costs, block costs, post costs)``.

    ``kind="flops"``: forward FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` (matmuls,
    attention, convolutions) plus one FLOP per output element for the element-wise work the
    counter does not see (embedding lookups, norms, activations), so no part costs zero. Backward is
    about 2x forward for every counted op (Kaplan et al. 2020, Sec. 2.1), which does not change the
    balance. ``kind="time"``: median forward wall time in seconds of ``repeats`` runs.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in ("flops", "time"):
        raise ValueError(f"block cost kind {kind!r} is unknown; valid: flops, time, params")
    out = ([], [], [])
    x = example_input
    with eval_mode(parts.all()):
        _measure(parts, x, kind, repeats, out)
    return out


def _measure(parts, x, kind, repeats, out) -> None:
    import time

    from torch.utils.flop_counter import FlopCounterMode

    for bucket, group in zip(out, (parts.pre, parts.blocks, parts.post)):
        for _, m in group:
            if kind == "flops":
                counter = FlopCounterMode(display=False)
                with counter:
                    y = m(x)
                numel = y.numel() if isinstance(y, torch.Tensor) else sum(
                    t.numel() for t in torch.utils._pytree.tree_leaves(y) if isinstance(t, torch.Tensor))
                bucket.append(float(counter.get_total_flops() + numel))
            else:
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    y = m(x)
                    ts.append(time.perf_counter() - t0)
                bucket.append(sorted(ts)[len(ts) // 2])
            x = y


def block_costs(parts: ModelParts, kind: str = "params", example_input: torch.Tensor | None = None) -> list[float]:
    """Per-block cost for stage balancing, the input part added to the first block and the output part
    to the last (they run on the first and last stage): ``"params"`` (parameter count, no input
    needed), ``"flops"`` or ``"time"`` (`measure_part_costs` on ``example_input``).

    Raises:
        ValueError: unknown kind, or ``"flops"`` / ``"time"`` without an example input.
    """
    if kind == "params":
        return block_param_costs(parts)
    if example_input is None:
        raise ValueError(f"block costs of kind {kind!r} need an example input (one micro-batch)")
    if parts.form == "forward":
        from modelpar.parallel.stages import part_costs

        if kind not in ("flops", "time"):
            raise ValueError(f"block cost kind {kind!r} is unknown; valid: flops, time, params")
        pre, blocks, post = part_costs(parts, example_input, kind=kind)
    else:
        pre, blocks, post = measure_part_costs(parts, example_input, kind=kind)
    blocks[0] += sum(pre)
    blocks[-1] += sum(post)
    return [max(c, 1e-12) for c in blocks]
