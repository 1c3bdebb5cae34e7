"""`TrainConfig`: every knob of `modelpar train`, as one typed dataclass.

It is read from a YAML/JSON file (``--config``) and CLI overrides by jsonargparse; the effective config
is printed and saved in the run record. Defaults are the main job: the GPT gpt-1m on the Python
standard-library corpus, 2 local CPU ranks, 880 steps of 16 samples x 128 bytes (1.8M tokens), AdamW
at 5e-3 after 40 warm-up steps, cosine to 5e-4.

They were chosen by tokens, since the loss-per-token curve does not depend on the host: the job
must end below validation loss 1.8 nats/byte within 3 minutes of training on the fastest host of its
kind and with margin on a slower one. The same 1.8M tokens as 440 steps of batch 32 (the
previous batch; cosine 4e-3 -> 4e-4, warm-up 30) ended at 1.889; as 880 steps of batch 16 at
1.765 with peak 5e-3 (4e-3: 1.787, 3e-3: 1.799), measured in one process (2 DDP ranks of 8 samples
each at 4e-3: 1.790, the same curve within 0.004). Twice the optimizer steps per token cost a little throughput (the planner
predicts -4%; a step's fixed costs, the gradient all-reduce among them, are paid per step), so the job
trains ~1.8M tokens in ~3 minutes on the slow 2-core host that ran batch 32 at 10,029 tokens/s.
README gives the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from modelpar.plan import AC_MODES, DEGREES, PP_SCHEDULES, ParallelPlan

PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelPlan))
_PLAN_DEFAULTS = dataclasses.asdict(ParallelPlan())


def _optional(tp):
    return tp if type(None) in typing.get_args(tp) else tp | None


# `PlanOptions`: every `ParallelPlan` field, optional. Made from ParallelPlan itself, so a field added
# to the plan is a config field and a command-line flag by itself (one source of truth).
PlanOptions = dataclasses.make_dataclass(
    "PlanOptions", [(n, _optional(tp), dataclasses.field(default=None))
                    for n, tp in typing.get_type_hints(ParallelPlan).items() if n in PLAN_FIELDS])
PlanOptions.__module__ = __name__             # picklable, and named where it is defined
PlanOptions.__doc__ = """The `ParallelPlan` fields a config sets; None: unset (from the strategy, the plan file
    or the planner, `modelpar.train.resolve`). Fields, types and meanings: `ParallelPlan`'s."""

# what an unset field means (command-line help; every other unset field: the strategy's / plan's)
UNSET = {"n_microbatches": "unset: 2 x pp", "stage_boundaries": "unset: the planner's split, `modelpar.stage_split`",
         "placement_devices": "unset: cuda:0,cuda:1 with 2 GPUs, else cpu,cpu",
         "activation_checkpointing": "unset: --plan's or the strategy's, else none; the planner's search (train "
                                     "--strategy auto, plan, estimate) tries every mode unless one is given",
         "ac_every": "unset: --plan's or the strategy's, else 1; the planner's search tries 2 and 4 unless one is given",
         "precision": "unset: --plan's, else bf16 on a CUDA GPU that supports it and fp32 on the CPU (train runs, plan and estimate price, the same rule; verify: fp32)"}


def plan_option_docs() -> dict[str, str]:
    """Field -> command-line help of `PlanOptions`: `ParallelPlan`'s description and what unset means."""
    from modelpar.cli.args import field_docs

    docs = field_docs(ParallelPlan)
    valid = {"pp_schedule": ", ".join(PP_SCHEDULES), "activation_checkpointing": ", ".join(AC_MODES)}
    out = {}
    for n in PLAN_FIELDS:
        text = docs.get(n, "").replace("``", "")
        if n in valid:
            text = f"{text} Valid: {valid[n]}."
        unset = UNSET.get(n) or ("unset: from --strategy or --plan" if n in DEGREES else
                                 f"unset: --plan's or the strategy's, else {_PLAN_DEFAULTS[n]}")
        out[n] = f"{text} ({unset})"
    return out


@dataclass
class TrainConfig:
    """Train a model with a parallel plan.

    Batch terms (one meaning each): global_batch_size = samples per optimizer step (the same on every
    layout); local_batch_size = samples in one forward/backward on one data-parallel rank; gradient
    accumulation steps = global / (local x data-parallel degree), derived.

    Args:
        model: built-in model: gpt-nano, gpt-1m, gpt-3m, gpt-10m (trainable here), larger gpt-* presets,
            mlp-small, mlp-large, mlp-deep, cnn; a Hugging Face causal LM: hf:<model_type> (hf:gpt2,
            hf:llama, ...), a config.json path, or a local pretrained folder (its weights loaded); or a
            factory module:factory / file.py:factory returning a language model (`modelpar.models.spec`;
            docs/your-model.md).
        model_config: a JSON object of overrides: GPTConfig fields of a GPT preset, e.g.
            {"n_layer": 8, "d_model": 512}, or fields of a Hugging Face config, e.g. {"n_layer": 4}.
        blocks: path of the nn.ModuleList / nn.Sequential holding the repeated blocks (empty: found).
        split_points: comma-separated block paths, each starting a pipeline stage (empty: balanced).
        strategy: auto (the planner picks the fastest plan that fits; the default), rules (the common
            rule-of-thumb advice), custom (exactly the degrees given below), or a shorthand: single,
            placement, ddp, fsdp, hsdp, tp, pp, ddp+tp, fsdp+tp. A degree that contradicts the shorthand
            is an error (giving degrees without a strategy means custom).
        plan: a plan file (plan.json, as `modelpar plan --explain K --json` or a run folder writes it)
            or its JSON text: the whole layout, instead of strategy and degrees.
        nproc: local ranks to launch (ignored under torchrun, which sets the world size).
        data: text file or folder for language models (default: the Python standard library's sources);
            with token_dtype, a token file or a folder with train.bin and val.bin.
        tokenizer: a tokenizer.json (Hugging Face tokenizers library) that encodes the text ("": bytes,
            ids 0..255; `modelpar.train.tokens`).
        token_dtype: uint16 or uint32: data is pre-tokenized, a flat array of token ids of this dtype
            (the nanoGPT format); "": data is text.
        steps: optimizer steps.
        global_batch_size: samples per optimizer step.
        local_batch_size: samples per forward/backward per data-parallel rank (0: global / dp).
        seq_len: tokens per sample for language models (0: a GPT preset's; min(the model's positions,
            1024) for a Hugging Face model; a factory model's max_positions, or required).
        lr: peak learning rate (AdamW), reached after warmup_steps, cosine-decayed to min_lr.
        min_lr: final learning rate.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or embeddings' 1-D params).
        optimizer: adamw, sgd or sgd_momentum (SGD with momentum 0.9).
        grad_clip: clip gradients to this global L2 norm (0: off).
        meta_init: Hugging Face models and the built-in GPT presets under FSDP, TP and pipelines (or one
            process): build on the meta device and give each rank memory for its own shards and stages
            only, filled from the pretrained folder's safetensors files (sliced) or, from a config, from
            (seed, parameter name), the same values on every layout but not those the model's own
            initialisation draws (`modelpar.train.materialise`).
        dropout: dropout probability of GPT and Hugging Face models (every dropout field of an HF config
            is set to it).
        eval_every: validate every N steps (and before and after training).
        eval_samples: validation samples per evaluation.
        seed: seed of initial weights, data order and dropout.
        threads: torch threads per rank (0: max(1, cores // local ranks)).
        timeout_s: collective timeout in seconds.
        out_dir: folder for run records.
        log_every: write metrics every N steps (and at the last): only then are the losses of the steps
            since the last log step read (one all-reduce for all of them) and, without clipping, the
            global gradient norm computed; the summary keeps every step's loss.
        sample_bytes: bytes of text to generate from the trained GPT at the end (0: none).
        track_memory: measure peak tensor bytes of one step with torch's MemTracker (CPU).
        compile: torch.compile each block (after TP and activation checkpointing, before FSDP/DDP).
        hardware: device profile for strategy auto/rules: a built-in name (A100-40GB, A100-80GB,
            H100-80GB-SXM, H200), a JSON file written by `modelpar calibrate`, or empty for this machine
            (the calibration file ~/.cache/modelpar/calibration.json if it exists, else an uncalibrated CPU
            estimate, or H100-80GB-SXM figures on CUDA).
        resume: continue a run from a checkpoint: "auto" (the latest complete checkpoint in ckpt_dir;
            a fresh start if there is none, so an elastic restart resumes by itself), or the path of a
            checkpoint folder or of a ckpt_dir; "" starts fresh. Any plan and world size may resume.
        ckpt_dir: folder of checkpoints (step-NNNNNNNN subfolders; "": OUT_DIR/checkpoints). Must be on a
            filesystem every rank sees.
        ckpt_every: save a checkpoint after every N optimizer steps, at step 0 and at the end (0: never);
            with it on, SIGTERM or SIGUSR1 (preemption, a scheduler's time limit) also saves one after the
            step in progress and stops the run (exit code 128 + the signal), to continue with --resume auto.
        keep_last: keep the newest K complete checkpoints in ckpt_dir (0: keep all).
        async_ckpt: write checkpoints in a background thread (torch.distributed.checkpoint.async_save);
            training goes on while the files are written.
        check_unused_params: check at every optimizer step that all data-parallel ranks gave gradients
            to the same parameters (rank-divergent control flow would mix gradients; case C12); one
            small all-reduce per step (DDP: the first step only), read on the host before the optimizer
            step, so on a GPU each step waits there for its backward to end.
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm over the data-parallel group (CUDA
            only; refused before launch on CPU). Without it BatchNorm uses per-rank batch statistics
            (case C15).
        layout: the `ParallelPlan` fields the user set (`PlanOptions`; unset fields come from the
            strategy, the plan file or the planner); on the command line each has its own flag
            (``--tp 2``, ``--pp-schedule gpipe``, ``--sequence-parallel``, ...).

    The constructor also takes plan fields by name, the flat form of configs written before
    ``layout`` (``TrainConfig(strategy="custom", tp=2)``, ``plan_options={...}``): they go into
    ``layout`` (`_set_fields`, which says how their old 'unset' values read).
    """

    model: str = "gpt-1m"
    model_config: dict = dataclasses.field(default_factory=dict)
    blocks: str = ""
    split_points: str = ""
    strategy: str = "auto"
    plan: str = ""
    nproc: int = 2
    data: str | None = None
    tokenizer: str = ""
    token_dtype: str = ""
    steps: int = 880
    global_batch_size: int = 16
    local_batch_size: int = 0
    seq_len: int = 0
    lr: float = 5e-3
    min_lr: float = 5e-4
    warmup_steps: int = 40
    weight_decay: float = 0.1
    optimizer: str = "adamw"
    grad_clip: float = 1.0
    dropout: float = 0.0
    meta_init: bool = False
    eval_every: int = 200
    eval_samples: int = 128
    seed: int = 0
    threads: int = 0
    timeout_s: float = 60.0
    out_dir: str = "runs"
    log_every: int = 1
    sample_bytes: int = 300
    track_memory: bool = True
    resume: str = ""
    ckpt_dir: str = ""
    ckpt_every: int = 0
    keep_last: int = 3
    async_ckpt: bool = False
    hardware: str = ""
    check_unused_params: bool = True
    sync_batchnorm: bool = False
    layout: PlanOptions = dataclasses.field(default_factory=lambda: PlanOptions())

    def to_dict(self) -> dict:
        """Every field; ``layout`` as a dict of every `ParallelPlan` field (None: unset), lists for
        tuples (YAML / JSON)."""
        d = dataclasses.asdict(self)
        d["layout"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["layout"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "config") -> "TrainConfig":
        """A config from `to_dict`'s form, or from the flat form of configs written before the
        ``layout`` field (``tp: 0``, ``pp_schedule: 1f1b``, ``plan_options: {...}``; see `TrainConfig`).

        Raises:
            ValueError: keys that are neither config nor plan fields (naming them).
        """
        known = {f.name for f in dataclasses.fields(cls)} | set(PLAN_FIELDS) | {"plan_options"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown TrainConfig fields {unknown}")
        return cls(**d)


def _set_fields(kw: dict, layout, plan_options) -> "PlanOptions":
    """The `PlanOptions` of a `TrainConfig` call: ``layout`` (a `PlanOptions` or a dict of plan
    fields, None values unset) with the flat form's plan fields on top: those popped from ``kw``
    (``TrainConfig(tp=2)``, a flat config file) and ``plan_options``. In the flat form a field's
    old 'unset' values mean unset: 0 and empty lists (the old degree and list defaults) and the
    field's `ParallelPlan` default, which the old config held for every field it mirrored."""
    if isinstance(layout, PlanOptions):
        base = {k: v for k, v in dataclasses.asdict(layout).items() if v is not None}
    else:
        base = dict(layout or {})
        bad = sorted(set(base) - set(PLAN_FIELDS))
        if bad:
            raise ValueError(f"layout has unknown ParallelPlan fields {bad}; valid: {list(PLAN_FIELDS)}")
    flat = {k: kw.pop(k) for k in PLAN_FIELDS if k in kw}
    opts = dict(plan_options or {})
    bad = sorted(set(opts) - set(PLAN_FIELDS))
    if bad:
        raise ValueError(f"plan_options has unknown ParallelPlan fields {bad}; valid: {list(PLAN_FIELDS)}")
    for k, v in {**flat, **opts}.items():
        if v is None or v == 0 and not isinstance(v, bool) or v in ([], ()) or v == _PLAN_DEFAULTS[k]:
            continue
        base[k] = v
    return PlanOptions(**{k: base.get(k) for k in PLAN_FIELDS})


_dataclass_init = TrainConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, layout=None, plan_options=None, **kw):
    _dataclass_init(self, *args, layout=_set_fields(kw, layout, plan_options), **kw)


TrainConfig.__init__ = _init
