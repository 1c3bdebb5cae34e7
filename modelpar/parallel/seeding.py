"""The per-rank seed policy for dropout (and any other randomness inside forward).

One device draws one dropout mask per activation. A parallel layout cannot reproduce those masks
bit for bit (the same element lives at another index of another rank's tensor), so layouts with
dropout on differ from one device by design; parity tests use dropout 0. What the policy does
guarantee is that the masks are *statistically* right:

- data-parallel ranks see different samples, so they draw independent masks: the seed depends on
  ``dp_rank``;
- pipeline stages hold different layers, so they draw independent masks: the seed depends on
  ``pp_rank``;
- tensor-parallel ranks hold the same activations in the replicated regions (the residual stream
  without sequence parallel), so they must draw the *same* mask there: the seed does not depend on
  ``tp_rank``. Inside DTensor-sharded regions torch's own RNG tracker (``torch.distributed.tensor``
  offset-based RNG) gives each shard its part of one logical mask.
"""

from __future__ import annotations

import torch

_DP_STRIDE = 1_000_003      # primes, so (dp_rank, pp_rank) pairs never collide for < 1e6 ranks
_PP_STRIDE = 7_919


def rank_seed(seed: int, *, dp_rank: int = 0, pp_rank: int = 0) -> int:
    """The seed of one rank: ``seed + 1000003 dp_rank + 7919 pp_rank`` (independent of ``tp_rank``)."""
    return seed + _DP_STRIDE * dp_rank + _PP_STRIDE * pp_rank


def seed_rank(seed: int, mesh) -> int:
    """Seed torch's CPU (and CUDA) generators for this rank of ``mesh`` (a `MeshInfo`); returns the seed."""
    s = rank_seed(seed, dp_rank=mesh.dp_rank, pp_rank=mesh.pp_rank)
    torch.manual_seed(s)
    return s
