"""The records `profile.profile_model` returns: `BlockProfile` (one pipeline-splittable block) and
`ModelProfile` (the whole model, with its autocast variant and refusals). Split out of `profile.py`,
which re-exports both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from modelpar.planner.records import GemmShape

@dataclass(frozen=True)
class BlockProfile:
    """One pipeline-splittable block, for the profiled batch. Units: counts, FLOPs, bytes."""

    name: str
    num_params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    fwd_mem_bytes: int          # bytes read + written by non-matmul, non-view forward ops
    bwd_mem_bytes: int
    fwd_ops: int                # non-view, non-matmul ops dispatched in forward
    bwd_ops: int
    saved_bytes: int            # bytes kept for backward (storages once, parameters excluded)
    saved_tp_sharded_bytes: int  # part of saved_bytes a TP split shards by the TP degree
    input_bytes: int            # the block's tensor inputs (what full checkpointing keeps)
    output_bytes: int           # the block's tensor outputs (what a pipeline stage sends)
    tp_sharded_params: int = 0  # parameters a TP split shards (colwise weight + bias, rowwise weight)
    # per parameter, in registration order: (numel, is a matrix (decayed by AdamW), TP-sharded)
    param_numels: tuple[tuple[int, bool, bool], ...] = ()
    fwd_gemms: int = 0          # matmul-class calls in forward (their mean size picks the FLOP/s)
    bwd_gemms: int = 0
    # bytes the matmul-class calls read + write: of parameters (once per micro-batch, whatever its
    # size) and of everything else (proportional to the batch); for the roofline's memory bound
    fwd_gemm_param_bytes: int = 0
    bwd_gemm_param_bytes: int = 0
    fwd_gemm_act_bytes: int = 0
    bwd_gemm_act_bytes: int = 0
    # fused attention kernels among the matmul-class calls: their FLOPs and calls (forward, backward),
    # timed at the calibrated attention rate rather than the GEMM curve
    fwd_attn_flops: int = 0
    bwd_attn_flops: int = 0
    attn_calls: int = 0
    # forward FLOPs the derived TP plan leaves whole on every TP rank (`profile_blocks.TPSplitScopes`: a
    # Linear it does not split, experts, a router): all matmul-class, then fused attention's; the rest
    # divides by the TP degree, and so does the same share of the backward (`loads._block_terms`)
    tp_whole_flops: tuple[int, int] = (0, 0)
    # rowwise modules of the derived TP plan inside the block (one all-reduce each per forward; -1: not
    # known, a module-less block or an older profile: two per transformer block, one per embed / head)
    tp_rowwise: int = -1
    # the busiest moments of the block's backward (see `_Lifetimes`), for the profiled batch, one per
    # trade-off between activations and gradients (early: the interior's gradients; later: weight
    # gradients made, activations freed): (live bytes beyond the saved bytes of this and earlier
    # blocks, i.e. gradient temporaries made by this block's backward less the saved tensors it already
    # freed (may be negative); live gradients made by later blocks' backward (the gradient w.r.t. this
    # block's output); elements of this block's parameters whose gradient AccumulateGrad has stored;
    # weight gradients computed but not yet stored, in elements of the parameters' dtype (their bytes
    # over its size: under autocast a matmul's compute-dtype weight gradient, before its cast to the
    # parameter's dtype, counts at its own bytes))
    bwd_peaks: tuple[tuple[int, int, int, int], ...] = ()
    # part of saved_bytes that is the block's own input (for a stage's first block that storage is
    # the batch or the pipeline's receive buffer, which the memory model counts there)
    saved_input_bytes: int = 0
    # part of saved_bytes that selective checkpointing frees: what the block's attention cores
    # (`modelpar.parallel.checkpointing.attention_cores`) save beyond their own inputs and beyond what
    # the block saves again outside them (a fused kernel: its log-sum-exp only, its output being the
    # output projection's saved input; the unfused math path: the (seq x seq) scores too); inside
    # the TP-sharded region (heads split), so sharded by the TP degree
    attn_core_saved_bytes: int = 0
    # parameters this block uses that an earlier block owns (a tied embedding and head, counted once,
    # in the earlier block): (owner block index, elements, is a matrix, TP-sharded) each. A pipeline
    # stage that holds this block but not the owner keeps its own copy (`parallel.ties`: the copies'
    # gradients are summed across the stages), with its gradient and optimizer state
    tied_numels: tuple[tuple[int, int, bool, bool], ...] = ()
    # the 2-D matrix products (mm / addmm) among the matmul-class calls, as a shape histogram for
    # shape-aware CPU pricing (`cost._load_times`): `records.GemmShape` entries (pass, layout, M, K,
    # N, the dimension that grows with the batch, calls), at the profiled batch; causal CPU
    # flash-attention calls too (layout ``"SDPA"``)
    gemm_shapes: tuple[GemmShape, ...] = ()
    # part of saved_bytes that is the input of a matmul module outside the TP-sharded region (a
    # colwise projection, a replicated head): under sequence parallel the all-gather's output, which
    # modelpar's runtime (DTensor's ColwiseParallel) keeps at full length for backward; Megatron-LM
    # re-gathers it in backward instead (`runtimes.regather_profile` sets this to 0)
    saved_gathered_bytes: int = 0
    # aten calls dispatched (views and matmuls too), fwd / bwd: each costs `Calibration.dispatch_overhead_s`
    fwd_calls: int = 0
    bwd_calls: int = 0
    # frozen parameters (``requires_grad=False``): per ``param_numels`` entry (``tied_frozen``: per
    # ``tied_numels`` entry) True where it is frozen; () where none is. A frozen parameter has no
    # gradient and no optimizer state, and data parallelism reduces no gradient of it
    # (`trainable_params`); the FLOPs, traffic and saved bytes above are those of the backward
    # autograd runs with the model's flags (no weight gradient of a frozen Linear)
    frozen: tuple[bool, ...] = ()
    tied_frozen: tuple[bool, ...] = ()
    # what a split backward keeps from a micro-batch's input pass (``I``) to its weight pass (``W``) besides
    # the graph: torch's ``stage_backward_input`` (torch.distributed.pipelining ``_backward``) captures the
    # gradient at each trainable parameter's first autograd node on the input's path (its ``param_groups``'
    # intermediates: a Linear's matmul output, a norm's output) for ``W``; counted as the tensor outputs of
    # the block's modules that hold trainable parameters directly (bytes, the profiled batch), and the part
    # of it a TP split shards (colwise outputs and what lies between a colwise Linear and its rowwise partner)
    wgrad_bytes: int = 0
    wgrad_tp_sharded_bytes: int = 0

    @property
    def trainable_params(self) -> int:
        """Elements of the block's parameters that require gradients (``num_params`` less the frozen)."""
        return self.num_params - sum(k for (k, _, _), f in zip(self.param_numels, self.frozen) if f)


@dataclass(frozen=True)
class ModelProfile:
    """Per-block profile of one forward/backward at ``batch_size`` samples and ``dtype``.

    ``arch`` carries shape facts the planner needs for divisibility (for a GPT: ``n_head``,
    ``d_model``, ``ffn``, ``n_layer``, ``vocab_size``, ``seq_len``); empty for other models.
    Per-sample quantities scale linearly with the micro-batch size (true for the FLOPs, traffic and
    activations of the models here: every term has one batch factor).
    """

    blocks: tuple[BlockProfile, ...]
    dtype: str                  # "fp32" or "bf16"
    batch_size: int             # samples in the profiled input
    tokens_per_sample: int      # sequence length for token models, 1 otherwise
    arch: dict[str, int] = dataclasses.field(default_factory=dict)
    tp_splits: tuple[tuple[str, str, int], ...] = ()   # dims the derived TP plan splits (legality.tp_splits)
    # the same model profiled as modelpar's runtime trains it in bf16 without FSDP (`profile_model`'s
    # ``autocast``): fp32 parameters under torch.autocast, so an fp32 residual stream, fp32 norm inputs
    # and a bf16 copy of a Linear's input per Linear; `planner.loads.rank_loads` reads it for plans
    # whose runtime autocasts (`plan.autocasts`). None: not profiled (the bf16 profile stands in)
    autocast: "ModelProfile | None" = dataclasses.field(default=None, compare=False, repr=False)
    # why the model's forward cannot be cut into pipeline stages, found by cutting its own weights as the
    # runtime does (`modelpar.cli.common.profile_for` on a factory model; the search then ranks no
    # pipeline); "": not found refused
    pipeline_refusal: str = ""
    # why train refuses the model under tensor parallel at any degree (no TP plan derives, or the guessed
    # Linear pairing is not its forward's data flow: `modelpar.parallel.tp_factory.tp_refusal`); the
    # search then ranks no layout with tp > 1; "": not found refused
    tp_refusal: str = ""

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def trainable_params(self) -> int:
        return sum(b.trainable_params for b in self.blocks)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(b.fwd_flops for b in self.blocks) / self.batch_size

    @property
    def train_flops_per_sample(self) -> float:
        return sum(b.fwd_flops + b.bwd_flops for b in self.blocks) / self.batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        d = dict(d)
        d["blocks"] = tuple(BlockProfile(**{**b, "param_numels": tuple(tuple(x) for x in b.get("param_numels", ())),
                                            "bwd_peaks": tuple(tuple(x) for x in b.get("bwd_peaks", ())),
                                            "tied_numels": tuple(tuple(x) for x in b.get("tied_numels", ())),
                                            "frozen": tuple(b.get("frozen", ())),
                                            "tied_frozen": tuple(b.get("tied_frozen", ())),
                                            "tp_whole_flops": tuple(b.get("tp_whole_flops", (0, 0))),
                                            "gemm_shapes": tuple(GemmShape(*x) for x in b.get("gemm_shapes", ()))})
                            for b in d["blocks"])
        ac = d.get("autocast")
        return cls(**{**d, "tp_splits": tuple(tuple(x) for x in d.get("tp_splits", ())),
                      "autocast": cls.from_dict(ac) if isinstance(ac, dict) else ac})
