"""Activation checkpointing: recompute activations in backward instead of storing them.

Non-reentrant `torch.utils.checkpoint` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"). Non-reentrant is the default on purpose (case C8): the reentrant variant gives no gradient to
a block's parameters when the block's input does not require grad.

Modes (``ParallelPlan.activation_checkpointing``):

- ``"full"``: every block; a block keeps only its input and recomputes its forward in backward.
- ``"every-k"``: blocks 0, k, 2k, ... of the model (``ParallelPlan.ac_every``; indices count the
  model's blocks, `modelpar.parallel.parts`, so a pipeline stage checkpoints the same blocks the whole
  model would).
- ``"selective"``: only each block's attention core, the softmax(QK^T) V region of Korthikanti et
  al. 2022, Sec. 5 (QK^T, softmax, dropout, attention over V), whose (seq x seq) intermediates
  dominate an unfused attention's saved bytes; the projections and the MLP keep their activations.
  The core is every submodule whose class sets ``modelpar_attention_core = True`` (the built-in
  GPT's `modelpar.models.gpt.AttentionCore`). With a fused attention kernel
  (``F.scaled_dot_product_attention`` on the flash / memory-efficient path, what torch runs on CPUs
  and current GPUs) the core saves no (seq x seq) tensor, only q, k, v (its inputs, kept), its
  output (the same storage the output projection saves as its input, so kept as well) and a
  (batch, heads, seq) log-sum-exp: selective checkpointing then frees only the log-sum-exp (measured
  on gpt-1m: 2 KiB per layer and sample of ~1 MiB saved, `BlockProfile.attn_core_saved_bytes`), at
  the price of running the attention forward twice. With the unfused (math) kernel, or attention
  dropout on CPU, it frees the (seq x seq) scores and probabilities, as in the paper.

  torch's selective-checkpoint API (``create_selective_checkpoint_contexts``) is not used: its policy
  runs the whole block again in backward and returns cached outputs for the ops it saves, so
  recomputing only the attention ops would cache every other op's output, including those autograd
  does not save (more memory than no checkpointing). Checkpointing the core module keeps exactly its
  inputs (q, k, v).

The checkpointed module's ``forward`` is replaced in place (no wrapper module), so parameter names,
state dicts and checkpoints are the same with and without checkpointing.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from modelpar.plan import AC_MODES as MODES
from modelpar.plan import CORE_ATTR     # the attention-core marker (defined beside the modes)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def attention_cores(block: nn.Module) -> list[nn.Module]:
    """The attention-core submodules of ``block`` (class attribute ``modelpar_attention_core``)."""
    return [m for m in block.modules() if getattr(type(m), CORE_ATTR, False)]


def checkpointed_indices(num_blocks: int, mode: str, every: int = 1) -> list[int]:
    """Indices (of the model's blocks) whose whole forward is recomputed: all for ``"full"``,
    0, k, 2k, ... for ``"every-k"`` with k = ``every``, none otherwise."""
    if mode == "full":
        return list(range(num_blocks))
    if mode == "every-k":
        return list(range(0, num_blocks, every))
    return []


def check_ac(blocks: list[tuple[str, nn.Module]], mode: str, every: int = 1) -> None:
    """Refuse a checkpointing request the model cannot honour, before anything is changed.

    Raises:
        ValueError: unknown mode, ``every`` < 1, or ``"selective"`` on a model with a block without
            an attention core (the first such block is named).
    """
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; valid: {', '.join(MODES)}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"ac_every must be a positive integer, got {every!r}")
    if mode == "selective":
        for name, b in blocks:
            if not attention_cores(b):
                raise ValueError(
                    f"activation_checkpointing='selective' recomputes each block's attention core, but block "
                    f"{name!r} ({type(b).__name__}) has none: modelpar finds it as a submodule whose class "
                    f"sets {CORE_ATTR} = True (as modelpar.models.gpt.AttentionCore does). " + (
                        "A Hugging Face block computes attention in a function, not a module: use 'full' or "
                        "'every-k'" if type(b).__module__.startswith("transformers") else
                        "Mark the module that computes softmax(QK^T)V, or use 'full' / 'every-k'"))


def _wrap(m: nn.Module) -> bool:
    if getattr(m, "_modelpar_ac", False):
        return False
    m.forward = functools.partial(_checkpointed, m.forward)
    m._modelpar_ac = True
    return True


def apply_ac(blocks: list[nn.Module], *, mode: str = "full", every: int = 1,
             indices: list[int] | None = None) -> int:
    """Checkpoint ``blocks`` as ``mode`` says (see the module docstring); ``"none"`` does nothing.

    Args:
        blocks: this rank's blocks, in model order.
        every: k of ``"every-k"``.
        indices: each block's index among the model's blocks (a pipeline stage holds a slice);
            None: 0, 1, 2, ...

    Returns the number of modules checkpointed (blocks, or attention cores for ``"selective"``).

    Raises:
        ValueError: as `check_ac`.
    """
    check_ac([(str(i), b) for i, b in enumerate(blocks)], mode, every)
    if mode == "none":
        return 0
    if mode == "selective":
        return sum(_wrap(c) for b in blocks for c in attention_cores(b))
    idx = list(range(len(blocks))) if indices is None else list(indices)
    chosen = set(checkpointed_indices(max(idx, default=-1) + 1, mode, every))
    return sum(_wrap(b) for b, i in zip(blocks, idx) if i in chosen)
