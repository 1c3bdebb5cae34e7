"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019, Sec. 3) with DTensor `parallelize_module`.

A colwise Linear splits its output features over the TP ranks, the following rowwise Linear splits its
input features and all-reduces its output, so each (colwise, rowwise) pair costs one all-reduce in
forward and one in backward. The plan is derived automatically:

- the built-in GPT: per block ``attn.q/k/v`` colwise, ``attn.o`` rowwise, ``mlp.up`` colwise,
  ``mlp.down`` rowwise; the token embedding and the output head split over the vocabulary (below);
- a Hugging Face model (`modelpar.models.hf.HFModel`): its own ``_tp_plan`` translated, else a plan
  derived from its blocks' projection groups (GPT-2's ``Conv1D`` and fused ``c_attn`` included), with
  vocab-parallel embedding and head and, for the llama / gpt2 families, sequence parallel
  (`modelpar.parallel.hf_tp`);
- a factory model holding a transformers model (e.g. at ``.hf`` of a wrapper): that model's plan, as
  for ``hf:`` models, under its path (`modelpar.parallel.tp_factory`);
- any chain of ``nn.Linear`` layers (with element-wise ops between them): consecutive pairs become
  (colwise, rowwise); an unpaired last Linear stays replicated. Pairs whose widths do not chain are
  refused, and before launch the forward's data flow is checked (`tp_factory.dataflow_refusal`).

Sequence parallel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4.2.2) for the GPT: the LayerNorms (and the dropouts after the rowwise Linears) work on
activations sharded along the sequence (dim 1); each rowwise Linear reduce-scatters into that layout
instead of all-reducing, and each attention / MLP all-gathers the sequence on entry. The embedding's
output is cut into sequence shards (no communication) and the head all-gathers before its Linear.

Vocabulary parallel (Megatron-LM's vocab-parallel embedding and output layer, Shoeybi et al. 2019,
Sec. 3): with ``shard_head`` the GPT token embedding ``embed.tok`` is split rowwise over the vocabulary
(each rank looks up its vocab range, out-of-range tokens give zeros, and one all-reduce sums the
lookups: torch's ``RowwiseParallel`` on an ``nn.Embedding``) and the output Linear colwise over the
vocabulary, its logits left a DTensor sharded on the vocab dim, so cross entropy (under torch's
``loss_parallel``) never gathers the full (batch, seq, vocab) logits on any rank. Both weights are
(vocab, d_model) and split on dim 0, so a tied head and embedding (case C13) share one sharding. The
vocabulary must be divisible by the TP degree (checked with the other splits).

A user may pass their own ``{module path: style}`` plan instead (styles: ``STYLES``).
Every split is checked before any process group exists (case C7), naming the module, the dimension
and the degree.
"""

from __future__ import annotations

import torch
import torch.nn as nn

COLWISE, ROWWISE = "colwise", "rowwise"
# sequence-parallel / loss-parallel variants of the GPT plan (see the module docstring)
ROWWISE_SEQ = "rowwise_seq"            # rowwise, output reduce-scattered to sequence shards
SEQ_NORM = "sequence_parallel"         # LayerNorm / Dropout on sequence shards
GATHER_SEQ_INPUT = "gather_seq_input"  # module input: sequence shards -> all-gathered
SHARD_SEQ_OUTPUT = "shard_seq_output"  # module output: replicated -> sequence shards (no communication)
COLWISE_VOCAB = "colwise_vocab"        # head Linear: logits stay a DTensor sharded on the vocab dim
COLWISE_VOCAB_SEQ = "colwise_vocab_seq"  # the same, from sequence-sharded input
ROWWISE_VOCAB = "rowwise_vocab"        # nn.Embedding split over its rows (the vocabulary), output replicated
_HF_STYLES = ("conv1d_colwise", "conv1d_rowwise", "conv1d_rowwise_seq", "conv1d_colwise_qkv",
              "shard_seq_input", "gather_seq_hidden", "colwise_gather", "rowwise_split",
              "replicated_grad_sum", "mla_rope_grad_sum")    # Hugging Face models: `modelpar.parallel.hf_tp`
STYLES = (COLWISE, ROWWISE, ROWWISE_SEQ, SEQ_NORM, GATHER_SEQ_INPUT, SHARD_SEQ_OUTPUT, COLWISE_VOCAB,
          COLWISE_VOCAB_SEQ, ROWWISE_VOCAB) + _HF_STYLES
INPUT_ONLY_STYLES = (GATHER_SEQ_INPUT, SHARD_SEQ_OUTPUT, "shard_seq_input", "gather_seq_hidden")  # no parameter split
COLWISE_STYLES = (COLWISE, COLWISE_VOCAB, COLWISE_VOCAB_SEQ)   # weight split on dim 0
ROWWISE_STYLES = (ROWWISE, ROWWISE_SEQ)                        # weight split on dim 1
_LINEAR_STYLES = {COLWISE: "out_features", COLWISE_VOCAB: "out_features", COLWISE_VOCAB_SEQ: "out_features",
                  ROWWISE: "in_features", ROWWISE_SEQ: "in_features", "colwise_gather": "out_features",
                  "rowwise_split": "in_features"}


def derive_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, shard_head: bool = False,
                   tp_degree: int | None = None) -> dict[str, str]:
    """``{module path: style}`` for the GPT, a Hugging Face model (`modelpar.parallel.hf_tp.hf_tp_plan`:
    its own ``_tp_plan`` translated, or a GPT-2 style plan derived; ``shard_head`` there means the
    vocab-parallel embedding and head, dropped when ``tp_degree`` does not divide the vocabulary; a
    transformers model inside a factory's model gets the same plan under its path,
    `modelpar.parallel.tp_factory`), or a chain of Linears (pairs whose widths chain only).

    Args:
        sequence_parallel: GPT only: shard LayerNorm/dropout regions along the sequence.
        shard_head: GPT only: split the token embedding and the output head over the vocabulary
            (loss parallel).

    Raises:
        ValueError: the model has fewer than two Linear layers to pair, or a pair whose widths do not
            chain (`tp_factory.check_pairs`); sequence_parallel or shard_head asked of a model other
            than the built-in GPT or a transformers model; see `hf_tp.hf_tp_plan`.
    """
    from modelpar.models.gpt import GPT
    from modelpar.parallel import hf_tp, tp_factory

    if hf_tp.is_hf(model):
        return hf_tp.hf_tp_plan(model, sequence_parallel=sequence_parallel, tp_degree=tp_degree,
                                loss_parallel=shard_head)
    view = None if isinstance(model, GPT) else tp_factory.hf_view(model)
    if view is not None:            # a transformers model inside a factory model: the hf: plan, re-prefixed
        return tp_factory.to_model_paths(hf_tp.hf_tp_plan(view[0], sequence_parallel=sequence_parallel,
                                                          tp_degree=tp_degree, loss_parallel=shard_head), view[1])
    if isinstance(model, GPT):
        sp = sequence_parallel
        row = ROWWISE_SEQ if sp else ROWWISE
        plan = {"embed": SHARD_SEQ_OUTPUT} if sp else {}
        for i in range(len(model.blocks)):
            p = f"blocks.{i}."
            if sp:
                plan.update({p + "ln1": SEQ_NORM, p + "attn": GATHER_SEQ_INPUT, p + "ln2": SEQ_NORM,
                             p + "mlp": GATHER_SEQ_INPUT})
            plan.update({p + "attn.q": COLWISE, p + "attn.k": COLWISE, p + "attn.v": COLWISE,
                         p + "attn.o": row, p + "mlp.up": COLWISE, p + "mlp.down": row})
        if shard_head:
            plan["embed.tok"] = ROWWISE_VOCAB
        if shard_head and sp:       # ln_f on sequence shards, the head Linear gathers them
            plan.update({"head.ln_f": SEQ_NORM, "head.out": COLWISE_VOCAB_SEQ})
        elif shard_head:
            plan["head.out"] = COLWISE_VOCAB
        elif sp:                    # the whole head (ln_f included) on the gathered sequence
            plan["head"] = GATHER_SEQ_INPUT
        return plan
    if sequence_parallel or shard_head:
        raise ValueError(f"sequence_parallel / loss parallel plans are derived for modelpar's GPT and transformers "
                         f"models only (hf:NAME, or one inside a factory's model); {type(model).__name__} holds "
                         f"neither and needs its own TP plan (parallelize(..., tp_plan=...) from Python)")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise ValueError(f"tensor parallel needs at least two nn.Linear layers to pair (colwise, rowwise); "
                         f"{type(model).__name__} has {len(linears)}: {tp_factory.HINT}")
    plan = {}
    for a, b in zip(linears[0::2], linears[1::2]):
        plan[a], plan[b] = COLWISE, ROWWISE
    tp_factory.check_pairs(model, plan)
    return plan


def default_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool | None = None,
                    tp_degree: int | None = None) -> tuple[dict[str, str], bool]:
    """The derived TP plan `parallelize` uses, and whether it splits the vocabulary.

    ``loss_parallel`` None: vocabulary parallel (embedding and head split over the vocabulary, the loss
    on vocab-sharded logits) for the built-in GPT and Hugging Face causal LMs (when ``tp_degree``, if
    given, divides their vocabulary), off for other models (their plans are derived from Linear
    chains); True / False force it (True only for the GPT and HF models).

    Raises:
        ValueError: see `derive_tp_plan`.
    """
    from modelpar.models.gpt import GPT

    from modelpar.parallel import hf_tp, tp_factory

    if hf_tp.is_hf(model) or (not isinstance(model, GPT) and tp_factory.hf_view(model) is not None):
        plan = derive_tp_plan(model, sequence_parallel=sequence_parallel, shard_head=loss_parallel is not False,
                              tp_degree=tp_degree)
        return plan, head_is_vocab_sharded(plan)
    shard = isinstance(model, GPT) if loss_parallel is None else bool(loss_parallel)
    return derive_tp_plan(model, sequence_parallel=sequence_parallel, shard_head=shard), shard


def tp_plan_for(model: nn.Module, *, sequence_parallel: bool = False, tp_degree: int | None = None) -> dict[str, str]:
    """The derived ``{module path: style}`` plan of any model (the planner's hook; `default_tp_plan`).

    Raises:
        ValueError: see `derive_tp_plan`.
    """
    return default_tp_plan(model, sequence_parallel=sequence_parallel, tp_degree=tp_degree)[0]


def tp_kinds(tp_plan: dict[str, str]) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` of the entries of ``tp_plan`` that split parameters
    (colwise: output features / vocabulary rows split; rowwise: input features or, for an embedding,
    its rows), for the planner (`modelpar.planner.profile`); Conv1D styles included."""
    col = (*COLWISE_STYLES, "conv1d_colwise", "conv1d_colwise_qkv", "colwise_gather")
    row = (*ROWWISE_STYLES, ROWWISE_VOCAB, "conv1d_rowwise", "conv1d_rowwise_seq", "rowwise_split")
    return {p: "colwise" if s in col else "rowwise" for p, s in tp_plan.items() if s in col or s in row}


def validate_tp_plan(model: nn.Module, tp_plan: dict[str, str], tp_degree: int, *, seq_len: int | None = None) -> None:
    """Check every split divides evenly (case C7), and the GPT's / a Hugging Face model's heads (query and
    key/value), vocabulary and (sequence parallel, ``seq_len`` given or the GPT's) sequence.

    Raises:
        ValueError: naming the module or config field, the dimension and the degree (for the GPT's
            vocabulary split: ``vocab_size`` and the degree).
    """
    if tp_degree == 1:
        return
    from modelpar.models.gpt import GPT
    from modelpar.parallel import hf_tp, tp_factory

    for path, style in tp_plan.items():
        if style not in STYLES:
            raise ValueError(f"TP plan entry {path!r} has style {style!r}; valid: {', '.join(STYLES)}")
    view = None if isinstance(model, GPT) or hf_tp.is_hf(model) else tp_factory.hf_view(model)
    if hf_tp.is_hf(model):
        hf_tp.check_hf_tp(model, tp_plan, tp_degree, seq_len=seq_len)
    elif view is not None:          # the transformers model inside a factory model
        try:
            hf_tp.check_hf_tp(view[0], tp_factory.to_view_paths(tp_plan, view[1]), tp_degree, seq_len=seq_len)
        except ValueError as e:     # the modules named by their paths in the model
            raise ValueError(str(e).replace("'hf.", f"'{view[1]}." if view[1] else "'")) from None

    if isinstance(model, GPT) and model.cfg.n_head % tp_degree:
        raise ValueError(f"tensor parallel degree {tp_degree} does not divide the number of attention "
                         f"heads n_head={model.cfg.n_head}")
    if isinstance(model, GPT) and SEQ_NORM in tp_plan.values() and model.cfg.seq_len % tp_degree:
        raise ValueError(f"sequence parallel: tensor parallel degree {tp_degree} does not divide the "
                         f"sequence length seq_len={model.cfg.seq_len}")
    modules = dict(model.named_modules())
    for path, style in tp_plan.items():
        m = modules.get(path)
        if m is None:
            raise ValueError(f"TP plan names {path!r}, which is not a module of {type(model).__name__}")
        if style not in STYLES:
            raise ValueError(f"TP plan entry {path!r} has style {style!r}; valid: {', '.join(STYLES)}")
        if style == ROWWISE_VOCAB:
            if not isinstance(m, nn.Embedding):
                raise ValueError(f"TP plan entry {path!r} is {type(m).__name__}; {ROWWISE_VOCAB} splits an "
                                 f"nn.Embedding over its rows")
            if m.num_embeddings % tp_degree:
                what = ("GPTConfig.vocab_size" if isinstance(model, GPT) and path == "embed.tok"
                        else f"{type(model.hf.config).__name__}.vocab_size" if hf_tp.is_hf(model)
                        else f"{type(view[0].hf.config).__name__}.vocab_size" if view is not None
                        else f"{path}.num_embeddings")
                raise ValueError(f"tensor parallel degree {tp_degree} does not divide {what}="
                                 f"{m.num_embeddings}: the token embedding and output head are split over "
                                 f"the vocabulary (vocab parallel); use a vocabulary that is a multiple of "
                                 f"{tp_degree} (pad it), or another TP degree")
            continue
        if style not in _LINEAR_STYLES:
            continue
        if not isinstance(m, nn.Linear):
            raise ValueError(f"TP plan entry {path!r} is {type(m).__name__}; only nn.Linear can be split")
        dim_name = _LINEAR_STYLES[style]
        dim = getattr(m, dim_name)
        if dim % tp_degree:
            raise ValueError(f"tensor parallel degree {tp_degree} does not divide {path}.{dim_name}={dim} "
                             f"({style} split of Linear({m.in_features}, {m.out_features}))")


def apply_tp(model: nn.Module, tp_mesh, tp_plan: dict[str, str], *, present: set[str] | None = None,
             own_outputs: bool = False) -> int:
    """Shard the Linears of ``tp_plan`` over ``tp_mesh`` in place; returns how many were split.

    ``present`` restricts to module paths that exist on this rank (pipeline stages hold only some).
    ``own_outputs``: the split modules' local outputs become tensors of their own (`_OwnOutput`), so
    a model's code may modify them in place (Falcon's ``mlp_output += attention_output``); torch's
    styles hand on ``DTensor.to_local()``, a view made inside an autograd Function, which autograd
    refuses to modify in place ("Output 0 of _ToTorchTensor is a view and is being modified inplace").
    """
    plan = {p: make_style(s) for p, s in tp_plan.items() if present is None or p in present}
    from modelpar.parallel import hf_tp

    hf_tp.prepare_modules(model, tp_plan, tp_mesh.size(), set(plan))   # GPT-2's fused q|k|v: per-rank heads
    if plan:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, plan)
    if own_outputs:
        for path in plan:
            if tp_plan[path] in _LOCAL_OUTPUT_STYLES:
                model.get_submodule(path).register_forward_hook(_own_output)
    for path, style in tp_plan.items():
        if style == ROWWISE_VOCAB and path in plan:
            model.get_submodule(path).weight.register_post_accumulate_grad_hook(_shard_grad_like_weight)
    return len(plan)


def _shard_grad_like_weight(p) -> None:
    """DTensor's embedding backward gives a vocab-sharded weight a Replicate gradient (the whole
    (vocab, d) on every TP rank, torch 2.13): keep only this rank's vocab shard, as the weight is
    laid out (a local slice, no communication), so the gradient and the optimizer step are sharded."""
    g = p.grad
    if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def make_style(style: str):
    """The torch `ParallelStyle` of a style name (sequence dim 1, vocab dim -1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    if style == COLWISE:
        return ColwiseParallel()
    if style == ROWWISE:
        return RowwiseParallel()
    if style == ROWWISE_SEQ:
        return RowwiseParallel(output_layouts=Shard(1))
    if style == SEQ_NORM:
        return SequenceParallel()
    if style == GATHER_SEQ_INPUT:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)
    if style == SHARD_SEQ_OUTPUT:
        return PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                   use_local_output=True)
    if style == COLWISE_VOCAB:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if style == ROWWISE_VOCAB:      # token ids replicated in, the summed lookups replicated out
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == COLWISE_VOCAB_SEQ:
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if style in _HF_STYLES:
        from modelpar.parallel.hf_styles import make_hf_style

        return make_hf_style(style)
    raise ValueError(f"TP style {style!r} is unknown; valid: {', '.join(STYLES)}")


def head_is_vocab_sharded(tp_plan: dict[str, str]) -> bool:
    """True when the plan leaves the logits sharded on the vocab dim (the loss must run under
    `torch.distributed.tensor.parallel.loss_parallel`)."""
    return any(s in (COLWISE_VOCAB, COLWISE_VOCAB_SEQ) for s in tp_plan.values())


# styles whose module hands on a local tensor (``DTensor.to_local()``; the vocab-parallel head's logits
# stay a DTensor)
_LOCAL_OUTPUT_STYLES = (COLWISE, ROWWISE, ROWWISE_SEQ, ROWWISE_VOCAB, "conv1d_colwise", "conv1d_rowwise",
                        "conv1d_rowwise_seq", "conv1d_colwise_qkv", "colwise_gather", "rowwise_split")


class _OwnOutput(torch.autograd.Function):
    """Identity (forward and backward) whose output is not a view of its input: ``x.detach()`` shares
    ``x``'s memory (no copy) and its version counter, so an in-place change of the output is allowed,
    and one that a saved tensor of the graph needs is still caught by autograd's version check."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _own_output(_module, _inputs, out):
    """Forward hook: a split module's local output as a tensor of its own (`_OwnOutput`), where autograd
    records it; DTensors and outputs without a graph are left as they are."""
    if isinstance(out, torch.Tensor) and out.requires_grad and not hasattr(out, "placements"):
        return _OwnOutput.apply(out)
    return None
