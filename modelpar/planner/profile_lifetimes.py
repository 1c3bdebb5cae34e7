"""Storage lifetimes of a profiled forward + backward (`_Lifetimes`), for each block's in-backward
peak in `modelpar.planner.profile`, and the hooks that tell a tied parameter's partial gradients apart
(`_hook_partial_grads`)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Lifetimes:
    """Storage lifetimes over the profiled forward + backward, to find each block's in-backward peak.

    Storages are registered when first saved for backward (forward) or when a backward op creates
    them; a weak reference on the storage (meta and fake storages are freed like real ones) records
    when autograd drops it. Backward ops are recorded with their block. After the backward, the
    storages that became parameter gradients are known (post-accumulate-grad hooks) and the timeline
    is replayed: at each backward op of block i the live activation bytes are the saved storages
    still alive plus the non-gradient storages made in backward, split into those made by block i
    ("own") and by later blocks ("in": the gradient flowing into block i); the op with the most live
    bytes is block i's peak.
    """

    def __init__(self, n: int):
        self.n = n
        self.live: dict[int, int] = {}        # storage key -> serial, while alive
        self.size: list[int] = []             # serial -> bytes
        self.creator: list[int] = []          # serial -> block whose backward made it (-1: forward / none)
        self.events: list[tuple[int, int]] = []   # (+1 new / -1 free / 0 op, serial or block)
        self.saved: set[int] = set()          # serials saved for backward
        self.grad_block: dict[int, int] = {}  # serial -> block, for storages that became parameter grads
        self.partial: set[int] = set()        # serials of partial gradients of a parameter used twice
        self.casts: dict[int, tuple] = {}     # serial made by a backward dtype cast -> its inputs' serials

    def add(self, t: torch.Tensor, creator: int) -> int:
        import weakref
        st = t.untyped_storage()
        key = st._cdata
        s = self.live.get(key)
        if s is not None:
            return s
        s = len(self.size)
        self.size.append(st.nbytes())
        self.creator.append(creator)
        self.live[key] = s
        self.events.append((1, s))
        weakref.finalize(st, self._free, key, s)
        return s

    def _free(self, key: int, s: int) -> None:
        if self.live.get(key) == s:
            del self.live[key]
        self.events.append((-1, s))

    def backward_op(self, block: int, args, out, cast: bool = False) -> None:   # cast: a ``_to_copy``
        ins = {t.untyped_storage()._cdata for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in ins:   # not in-place
                s = self.add(t, block)
                if cast:
                    self.casts[s] = tuple(self.live[k] for k in ins if k in self.live)
        self.events.append((0, block))

    def grad(self, p: torch.Tensor, block: int) -> None:
        # a weight gradient is a temporary of its matmul until AccumulateGrad stores it as .grad
        if p.grad is not None:
            s = self.add(p.grad, -1)
            if s not in self.grad_block:
                self.grad_block[s] = block
                self.events.append((2, s))

    def partial_grad(self, t: torch.Tensor) -> None:
        """``t`` is one use's gradient of a parameter used more than once (a tied embedding and head):
        autograd holds it in the parameter's AccumulateGrad input buffer until the last use's
        gradient arrives and the sum is stored. Its size is the parameter's, not the batch's, so
        `block_peaks` counts it with the pending weight gradients, not with the activations."""
        self.partial.add(self.add(t, -1))

    def block_peaks(self) -> list[list[tuple[int, int, int, int]]]:
        """Per block, the backward ops no other op of the block beats on both live activation bytes
        and live gradient bytes of the block's parameters: (own live bytes, incoming-gradient live
        bytes, stored gradient bytes, computed-not-yet-stored gradient bytes), by increasing gradient
        bytes. The computed-not-yet-stored bytes include the live partial gradients of parameters
        used more than once (`partial_grad`), whichever block owns them: they are alive while the
        blocks between the two uses run their backward."""
        saved, grad_block, size, creator = self.saved, self.grad_block, self.size, self.creator
        partial = self.partial - set(grad_block)    # a partial that became the .grad is a gradient
        # autocast: a matmul's weight gradient is its bf16 copy's, cast to become the .grad: pending, not an activation
        wcopy = {i: grad_block[o] for o, ins in self.casts.items() if o in grad_block
                 for i in ins if creator[i] >= 0 and i not in grad_block and i not in saved}
        partial_live = 0
        cur_saved = 0
        bw_total = 0
        bw_by = [0] * self.n
        grads_by = [0] * self.n
        pending_by = [0] * self.n
        fronts: list[list[tuple]] = [[] for _ in range(self.n)]   # (total, grads, own, in, stored, pending)
        alive: set[int] = set()
        stored: set[int] = set()              # gradients AccumulateGrad has stored

        def count(s: int, nb: int) -> None:
            nonlocal cur_saved, bw_total, partial_live
            if s in stored:
                grads_by[grad_block[s]] += nb
            elif s in grad_block:
                pending_by[grad_block[s]] += nb
            elif s in wcopy:
                pending_by[wcopy[s]] += nb
            elif s in partial:
                partial_live += nb
            elif s in saved:
                cur_saved += nb
            elif creator[s] >= 0:
                bw_total += nb
                bw_by[creator[s]] += nb

        for kind, x in self.events:
            if kind == 0:
                own = cur_saved + bw_by[x]
                tot = cur_saved + bw_total
                g = grads_by[x] + pending_by[x] + partial_live
                f = fronts[x]
                if not any(e[0] >= tot and e[1] >= g for e in f):
                    f[:] = [e for e in f if not (tot >= e[0] and g >= e[1])] + [
                        (tot, g, own, tot - own, grads_by[x], pending_by[x] + partial_live)]
            elif kind == 2:                   # became a parameter's .grad
                if x in alive:
                    count(x, -size[x])
                    stored.add(x)
                    count(x, size[x])
                else:
                    stored.add(x)
            elif kind > 0:
                alive.add(x)
                count(x, size[x])
            elif x in alive:
                alive.discard(x)
                count(x, -size[x])
        return [[e[2:] for e in sorted(f, key=lambda e: e[1])] for f in fronts]


def _hook_partial_grads(outs, life) -> list:
    """Hooks on the autograd nodes that feed a parameter used more than once (a tied embedding and
    head: two edges into its AccumulateGrad node), so each use's gradient is known to `life` as a
    partial gradient (`_Lifetimes.partial_grad`). Returns the hook handles."""
    edges: dict[object, list[tuple[object, int]]] = {}
    seen, todo = set(), [o.grad_fn for o in outs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for j, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):          # AccumulateGrad of a leaf
                edges.setdefault(nxt, []).append((node, j))
            else:
                todo.append(nxt)
    hooks: dict[object, list[int]] = {}
    for acc, uses in edges.items():
        if len(uses) > 1:
            for node, j in uses:
                hooks.setdefault(node, []).append(j)

    def hook(js):
        def fn(grad_inputs, grad_outputs):
            for j in js:
                if grad_inputs[j] is not None:
                    life.partial_grad(grad_inputs[j])
        return fn
    return [node.register_hook(hook(js)) for node, js in hooks.items()]
