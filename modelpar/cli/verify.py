"""`modelpar verify`: does my model train under this plan exactly as on one process?

Trains N steps of a built-in model, or of the user's own model given as ``module:factory``, under a
parallel plan on ``plan.world_size`` local ranks, and the same steps on one process from the same
initial weights; prints the per-step loss differences, the largest parameter difference and
PASS / FAIL against the project's tolerance (`modelpar.verify.compare`). Exit code 0 on PASS, 1 on
FAIL, 2 on bad input.

On FAIL the likely reason is printed where the model has one (BatchNorm, dropout). Exit code 0 on
PASS, 1 on FAIL, 2 on bad input (also an error every rank raised, e.g. rank-divergent parameter use,
case C12), 1 when a rank crashed (named with its first error line; `modelpar.rank_outcome`).

Your own model is named as ``module:factory`` or ``path/to/file.py:factory``; the factory
protocol is documented once, in `modelpar.models.spec`. The launcher resolves the plan once and
writes it (``plan.json``) with the options (``verify.yaml``) into a folder the ranks read.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.options import BATCH_TERMS, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions, PartsOptions

EXAMPLES = """examples:
  modelpar verify --model gpt-nano --plan '{"pp": 2, "n_microbatches": 2}'
  modelpar verify --model gpt-nano --strategy fsdp+tp --nproc 4 --steps 5
  modelpar verify --model gpt-nano --dp-shard 2 --tp 2 --sequence-parallel --nproc 4
  modelpar verify --model mypkg.models:make_model --plan plan.json --input-shape 32 --num-classes 10
  modelpar verify --model gpt-nano --nnodes 2 --gpus-per-node 4 --dp-shard 4 --tp 2   # prints the per-node launch line
"""


@dataclass
class VerifyOptions:
    """The comparison run.

    Args:
        steps: optimizer steps under the plan and on one process.
        local_batch_size: samples per forward/backward per data-parallel rank (0: global / dp).
        optimizer: adamw, sgd or sgd_momentum (SGD with momentum 0.9).
        lr: learning rate.
        grad_clip: global L2 clip norm (0: off).
        input_shape: factory models: per-sample input shape, e.g. 32 or 3,8,8.
        num_classes: factory models: classes of the output.
        seed: seed of the weights (built-in models) and of the batches.
        out: write the report as JSON to this file.
    """

    steps: int = 10
    local_batch_size: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    grad_clip: float = 0.0
    input_shape: str = ""
    num_classes: int = 0
    seed: int = 0
    out: str = ""


def build_parser():
    from modelpar.cli.options import add_plan_fields
    from modelpar.train.config import TrainConfig

    p = make_parser("modelpar verify", __doc__.split("\n\n")[1], epilog=EXAMPLES + "\n" + BATCH_TERMS,
                    config_file=True)
    add_fields(p, ModelOptions)
    add_fields(p, PartsOptions)
    add_fields(p, LayoutOptions)
    add_fields(p, BatchOptions)
    add_fields(p, HardwareOptions)
    add_fields(p, VerifyOptions)
    add_fields(p, TrainConfig, only=("check_unused_params", "sync_batchnorm"))
    add_plan_fields(p)                           # the same plan flags as train / estimate / plan
    p.add_argument("--run-dir", default="", help="a folder with verify.yaml and plan.json written by the "
                   "launcher (what each rank is started with)")
    return p


def as_train_config(args, given: set[str]):
    """The `TrainConfig` whose plan fields are verify's options (for `modelpar.train.resolve`)."""
    from modelpar.train.config import TrainConfig

    from modelpar.cli.options import plan_fields_given, strategy_given

    layout, strategy = plan_fields_given(args), strategy_given(args, given)
    # the planner (auto, rules) profiles the model itself; the other strategies resolve from the flags alone,
    # so a factory of verify's own form (batch_fn / loss_fn, which train's config cannot hold) stands aside
    real = ":" not in args.model or strategy.lower() in ("auto", "rules")
    return TrainConfig(model=args.model if real else "gpt-nano", plan=args.plan, nproc=args.nproc,
                       global_batch_size=args.global_batch_size, local_batch_size=args.local_batch_size,
                       seq_len=args.seq_len, optimizer=args.optimizer, hardware=args.hardware, seed=args.seed,
                       model_config=args.model_config if real else {}, strategy=strategy, layout=layout)


def resolve_plan(args, given: set[str] = frozenset()):
    """``(plan, local batch size)`` of ``--plan`` (JSON text or file), ``--strategy`` / ``--nproc`` or
    degrees, resolved once (`modelpar.train.resolve`; ``auto`` and ``rules`` need a built-in model).

    Raises:
        ValueError: contradicting options, bad JSON, unknown fields.
    """
    from modelpar.train.resolve import resolve

    cfg = as_train_config(args, given)         # degrees without --strategy: custom (strategy_given)
    from modelpar.models.spec import build_factory, model_kind

    if cfg.strategy.lower() in ("auto", "rules") and not args.plan and model_kind(args.model) == "factory":
        um = build_factory(args.model)
        if um.batch_fn is not None or um.loss_fn is not None:
            raise ValueError(f"--strategy {cfg.strategy} plans the forms train runs (a language model or a classifier); "
                             f"--model {args.model!r} brings its own batch_fn / loss_fn: give --strategy (ddp, fsdp, "
                             f"tp, pp, ...), degrees or --plan")
    from modelpar.cli.options import run_world_size

    world = run_world_size(args, given, cfg.strategy)     # as train: 1 for single / placement, a plan file's own
    r = resolve(cfg, world, measure_if_missing=False)
    return r.plan.validate(world), r.local_batch_size


def load_task(args):
    """``(model, batch_fn, loss_fn, loss_reduction, description)`` for ``--model``; the same on every rank.
    A language model's samples are ``--seq-len`` tokens (0: the default every command uses,
    `modelpar.cli.common.hf_seq_len` / `factory_lm_seq_len`).

    Raises:
        ValueError: unknown built-in model, a factory that cannot be imported or returns something
            else than documented (`modelpar.models.spec`), a user model whose input shape cannot be
            inferred, a --seq-len beyond the model's positions, or a factory language model that
            declares no max_positions and is given no --seq-len.
    """
    import torch

    from modelpar.models import MLP_PRESETS, PRESETS
    from modelpar.models.spec import build_builtin, build_factory, check_model, infer_classifier_shapes
    from modelpar.train.task import classification_loss, lm_loss

    gb = args.global_batch_size
    if check_model(args.model, args.model_config) == "builtin":
        if args.model in PRESETS:
            kw = {"seq_len": args.seq_len} if args.seq_len else {}
            model = build_builtin(args.model, args.model_config, seed=args.seed, dropout=0.0, **kw)
            seq = model.cfg.seq_len

            vocab = model.cfg.vocab_size

            def batch_fn(step):             # holds no reference to the model (run_rank hands it over)
                g = torch.Generator().manual_seed(args.seed * 100003 + step)
                w = torch.randint(0, vocab, (gb, seq + 1), generator=g)
                return w[:, :-1], w[:, 1:]
            return model, batch_fn, lm_loss, "mean", args.model
        model = build_builtin(args.model, args.model_config, seed=args.seed)
        shape = (MLP_PRESETS[args.model][0],) if args.model in MLP_PRESETS else (1, 8, 8)
        classes = MLP_PRESETS[args.model][-1] if args.model in MLP_PRESETS else 10
        return model, _random_batches(shape, classes, gb, args.seed), classification_loss, "mean", args.model
    if check_model(args.model, args.model_config) == "hf":
        return _hf_task(args)
    um = build_factory(args.model)
    batch_fn = um.batch_fn
    from modelpar.models import GPT

    if batch_fn is None and isinstance(um.model, GPT) and "task" not in um.extra:
        # a factory returning modelpar's own GPT: a language model of its config (token ids in)
        um.extra.update(task="lm", vocab_size=um.model.cfg.vocab_size, max_positions=um.model.cfg.seq_len)
        if not args.seq_len:
            args.seq_len = um.model.cfg.seq_len
    if batch_fn is None and um.extra.get("task") == "lm":     # the language-model form (models/spec.py)
        return _factory_lm_task(args, um)
    if batch_fn is None:
        declared = um.extra.get("input_shape")        # the factory's classifier form (as train reads it)
        given = _input_shape(args.input_shape) if args.input_shape else tuple(declared) if declared else None
        shapes = infer_classifier_shapes(um.model, given, args.num_classes or um.extra.get("num_classes", 0))
        if shapes is None:
            raise ValueError(f"--model {args.model!r}: give --input-shape and --num-classes, or return a "
                             f"'batch_fn' from the factory (no nn.Linear to infer them from)")
        batch_fn = _random_batches(shapes[0], shapes[1], gb, args.seed)
    return (um.model, batch_fn, um.loss_fn or classification_loss, um.loss_reduction,
            f"{type(um.model).__name__} from {args.model}")


def _input_shape(text: str) -> tuple[int, ...]:
    """``--input-shape`` ("3,16,16", or the JSON list "[3,16,16]") as a tuple of positive ints.

    Raises:
        ValueError: anything else, naming the flag and the value."""
    try:
        dims = tuple(int(d) for d in text.strip().strip("[]()").split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise ValueError(f"--input-shape {text!r}: one sample's shape as positive ints, e.g. --input-shape 3,32,32")
    return dims


def _hf_task(args):
    """A Hugging Face model (dropout forced to 0) with random token ids or pixels and labels."""
    import torch

    from modelpar.models.hf import build_hf, facts
    from modelpar.train.task import classification_loss, lm_loss

    model = build_hf(args.model, args.model_config, seed=args.seed, dropout=0.0)
    f, gb = facts(model.hf.config), args.global_batch_size
    if f.task == "classify":
        shape = (f.num_channels or 3, f.image_size, f.image_size)
        return model, _random_batches(shape, f.num_labels, gb, args.seed), classification_loss, "mean", args.model
    from modelpar.cli.common import hf_seq_len

    seq = hf_seq_len(args.model, model.hf.config, args.seq_len)     # 0: the default every command uses
    from modelpar.models.hf_unused import freeze_unreached

    freeze_unreached(model, args.model, args.model_config, seq)     # as train: both sides of the comparison

    def batch_fn(step):
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        w = torch.randint(0, f.vocab, (gb, seq + 1), generator=g)
        return w[:, :-1], w[:, 1:]
    return model, batch_fn, lm_loss, "mean", args.model


def _factory_lm_task(args, um):
    """A factory language model ({"model", "task": "lm", "vocab_size", "max_positions"}): random ids."""
    import torch

    from modelpar.train.task import lm_loss

    vocab, maxpos, gb = um.extra.get("vocab_size"), um.extra.get("max_positions"), args.global_batch_size
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model {args.model!r}: a factory language model must declare 'vocab_size' as a "
                         f"positive int, got {vocab!r}")
    from modelpar.cli.common import factory_lm_seq_len

    seq = factory_lm_seq_len(args.model, um.extra, args.seq_len)   # 0: its max_positions, as every command

    def batch_fn(step):
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        w = torch.randint(0, vocab, (gb, seq + 1), generator=g)
        return w[:, :-1], w[:, 1:]
    return um.model, batch_fn, um.loss_fn or lm_loss, um.loss_reduction, f"{type(um.model).__name__} from {args.model}"


def _random_batches(shape, classes: int, gb: int, seed: int):
    import torch

    def batch_fn(step):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        return torch.randn(gb, *shape, generator=g), torch.randint(0, classes, (gb,), generator=g)
    batch_fn.classes = classes             # the labels it draws are < classes (`_check_forward` checks the logits)
    return batch_fn


def format_report(desc: str, plan, world: int, rep, ref, got, hints: list[str] = (), *,
                  global_batch: int = 0, local: int = 0) -> str:
    """The parity table and verdict. ``global_batch`` / ``local``: samples per optimizer step and per
    forward/backward on one data-parallel rank; when given, the header names them and the accumulation
    (global / (local x dp)) and pipeline micro-batches they imply."""
    batch = ""
    if global_batch and local:
        batch = (f"; batch {global_batch} = local {local} x dp {plan.dp} x "
                 f"{global_batch // (local * plan.dp)} accumulation step(s)")
        if plan.pp > 1:
            batch += f", {plan.n_microbatches} micro-batches of {local // plan.n_microbatches}"
    lines = [f"modelpar verify: {desc}, plan {plan.describe()} on {world} rank(s) vs 1 process, "
             f"{len(ref.losses)} steps{batch}",
             f"{'step':>4}  {'loss 1 process':>15}  {'loss plan':>15}  {'rel diff':>9}  {'grad-norm rel diff':>18}"]
    for i, (a, b) in enumerate(zip(ref.losses, got.losses)):
        gn = abs(ref.grad_norms[i] - got.grad_norms[i]) / max(abs(ref.grad_norms[i]), 1e-12)
        lines.append(f"{i:>4}  {a:>15.8f}  {b:>15.8f}  {abs(a - b) / max(abs(a), 1e-12):>9.2e}  {gn:>18.2e}")
    lines.append(f"largest parameter difference: {rep.max_param_abs_diff:.3e} (abs); "
                 f"||delta|| / ||theta|| = {rep.param_rel_norm_diff:.3e}")
    lines.append("tolerance: loss 1e-5 relative per step; parameters |delta| <= 1e-4 + 1e-4 |theta| per element "
                 "and ||delta||/||theta|| <= 1e-5 (SGD: |delta| <= 1e-5 |theta| + 1e-7); grad norm 1e-5 relative")
    lines.append("PASS" if rep.passed else "FAIL:\n  " + "\n  ".join(rep.failures))
    if not rep.passed and hints:
        lines.append("likely reason:\n  " + "\n  ".join(hints))
    return "\n".join(lines)


def noise_hints(rep, optimizer: str) -> list[str]:
    """The FAIL report's hint when only single parameter elements differ under AdamW (losses, gradient
    norms and ||delta|| / ||theta|| agree): rounding noise that AdamW scales to lr-sized steps."""
    if optimizer == "sgd" or not rep.failures or not all("elementwise difference" in f for f in rep.failures):
        return []
    return ["only single elements differ (losses, gradient norms and ||delta|| / ||theta|| agree): AdamW turns an "
            "element's rounding-noise gradient (one that is zero in exact arithmetic, e.g. nn.MultiheadAttention's "
            "key bias) into lr-sized steps of either sign; --optimizer sgd compares the gradients themselves"]


def run_rank(args, plan, local: int, probe=None) -> int:
    """What every rank runs; rank 0 also runs the one-process reference and prints the report.

    The parallel run trains the model this rank built (no copy: a pipeline rank holds only its own
    stages); rank 0 then builds the reference again from the same ``--model`` and seed and checks
    that its initial weights are bitwise those of the parallel run (`verify.weights_digest`; a factory
    must seed itself) before training it on one process. ``probe``: see `modelpar.verify.run_steps`.
    """
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import MeshInfo, init_distributed
    from modelpar.plan import ParallelPlan
    from modelpar.verify import compare, run_steps, weights_digest

    rank, world = init_distributed(timeout_s=120)
    torch.set_num_threads(1 if world > 1 else max(1, os.cpu_count() or 1))
    model, batch_fn, loss_fn, reduction, desc = load_task(args)
    from modelpar.parallel.parts import split_points_of

    kw = dict(loss_fn=loss_fn, batch_fn=batch_fn, steps=args.steps, global_batch_size=args.global_batch_size,
              optimizer=args.optimizer, lr=args.lr, grad_clip=args.grad_clip, loss_reduction=reduction)
    init = weights_digest(model) if rank == 0 else None
    box = [model]
    del model                                # run_steps owns it from here (box.pop hands it over)
    got = run_steps(box.pop, plan, local_batch_size=local, check_unused_params=args.check_unused_params,
                    split_points=split_points_of(args.split_points), blocks=args.blocks or None,
                    sync_batchnorm=args.sync_batchnorm, probe=probe, **kw)
    code = 0
    if rank == 0:
        model = load_task(args)[0]           # the reference: the same --model and seed, built again
        ref = run_steps(model, ParallelPlan(), local_batch_size=args.global_batch_size,
                        mesh=MeshInfo(mesh=None), **kw)
        rep = compare(desc, ref, got, optimizer=args.optimizer)
        if weights_digest(model) != init:
            rep.passed = False
            rep.failures.insert(0, f"--model {args.model!r} built different initial weights on its second call "
                                   f"(the one-process reference); a factory must seed itself so that every call "
                                   f"returns the same weights")
        from modelpar.parallel.layer_checks import parity_hints

        print(format_report(desc, plan, world, rep, ref, got, parity_hints(model) + noise_hints(rep, args.optimizer),
                            global_batch=args.global_batch_size, local=local), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({**rep.to_dict(), "plan": plan.to_dict(),
                                                  "ref_losses": ref.losses, "losses": got.losses}, indent=1))
        code = 0 if rep.passed else 1
    if dist.is_initialized():
        box = [code]
        dist.broadcast_object_list(box, src=0)
        code = box[0]
    return code


def _check_before_launch(args, plan, local: int) -> None:
    """Bad --model / plan fail here, before any process starts (cases C5, C7)."""
    from modelpar.models.spec import check_model
    from modelpar.plan import gradient_accumulation_steps

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    gradient_accumulation_steps(args.global_batch_size, local, plan.dp)
    plan.validate(plan.world_size, local_batch_size=local)
    if plan.precision != "fp32":       # the reference is one fp32 process, compared at fp32 tolerances
        src = f"--plan {args.plan!r} (precision={plan.precision!r})" if args.plan else f"--precision {plan.precision}"
        raise ValueError(f"{src}: verify compares the layout with one fp32 process at fp32 tolerances (loss 1e-5 "
                         f"relative), which {plan.precision} compute misses by design; verify the layout in fp32 "
                         f"(--precision fp32, or precision \"fp32\" in the plan) and train {plan.precision} with "
                         f"`modelpar train --precision {plan.precision}`")
    model, batch_fn, loss_fn = load_task(args)[:3]
    if check_model(args.model, args.model_config) == "factory":     # a form it cannot run: one line, now
        x0 = batch_fn(0)[0]
        if hasattr(x0, "shape") and x0.shape[0] != args.global_batch_size:    # a factory's own batch_fn
            raise ValueError(f"--model {args.model!r}: batch_fn(0) returned {x0.shape[0]} samples, but the global "
                             f"batch is {args.global_batch_size}: batch_fn(step) returns the whole global batch "
                             f"of a step; give --global-batch-size {x0.shape[0]} or make it return "
                             f"{args.global_batch_size}")
        _check_forward(args.model, model, batch_fn, loss_fn)
    tp_plan = None
    if plan.tp > 1:                              # case C7: a split that does not divide (vocabulary too)
        from modelpar.parallel.tensor import default_tp_plan, validate_tp_plan

        tp_plan = default_tp_plan(model, sequence_parallel=plan.sequence_parallel, tp_degree=plan.tp)[0]
        x0 = batch_fn(0)[0]                                              # the sequence, for sequence parallel
        validate_tp_plan(model, tp_plan, plan.tp, seq_len=x0.shape[1] if x0.dim() == 2 else None)
        from modelpar.parallel.tp_factory import check_guess

        check_guess(model, tp_plan, x0[:1])         # a guessed Linear pairing: its forward's data flow
    from modelpar.parallel.parts import ModelParts, get_model_parts, split_points_of
    from modelpar.parallel.ties import check_ties

    sp, blk = split_points_of(args.split_points), args.blocks or None
    from modelpar.parallel.cut import check_split_points

    check_split_points(sp, plan)
    mb = max(1, local // (plan.n_microbatches if plan.pp > 1 else 1))
    if plan.pp > 1 or plan.activation_checkpointing != "none" or sp or blk:   # blocks needed: refused here
        parts = get_model_parts(model, sp, blocks=blk, example_input=batch_fn(0)[0][:mb])
    else:
        try:
            parts = get_model_parts(model)
        except ValueError:
            parts = ModelParts(form="whole")
    if plan.pp > 1:
        _check_stages(parts, plan, sp, batch_fn(0)[0][:mb])
    if plan.activation_checkpointing != "none":   # selective on blocks without an attention core
        from modelpar.parallel.checkpointing import check_ac
        check_ac(parts.blocks, plan.activation_checkpointing, plan.ac_every)
    check_ties(model, plan, parts, tp_plan=tp_plan)     # case C13: a layout that breaks a tie
    from modelpar.parallel.batchnorm import check_sync_batchnorm
    from modelpar.parallel.mesh import get_device

    check_sync_batchnorm(args.sync_batchnorm, get_device().type, [model])    # case C15


def _check_forward(name: str, model, batch_fn, loss_fn) -> None:
    """A factory model's one forward on the first sample of its first batch
    (`modelpar.models.factory_check.check_forward`): modelpar's losses need logits of the form's shape;
    a factory's own loss_fn takes whatever its forward returns."""
    import torch

    from modelpar.models.factory_check import check_forward
    from modelpar.train.task import classification_loss, lm_loss

    x = batch_fn(0)[0]
    if isinstance(x, torch.Tensor):
        form = "lm" if loss_fn is lm_loss else "classify" if loss_fn is classification_loss else "custom"
        check_forward(name, model, x[:1], form=form, classes=getattr(batch_fn, "classes", 0))


def _check_stages(parts, plan, split_points, example) -> None:
    """The pipeline cut before launch: enough blocks, valid split points, and (a model cut inside its own
    forward) the chained stages equal the whole forward (`modelpar.parallel.stages.check_chain`)."""
    from modelpar.parallel import stages
    from modelpar.parallel.pipeline import split_stages

    plan.validate(plan.world_size, num_blocks=parts.num_blocks)
    bounds = plan.stage_boundaries
    if split_points:
        bounds = stages.boundaries_from_split_points(parts, split_points, plan.num_stages)
    ranges = split_stages(parts, plan.num_stages, bounds)
    if parts.form == "forward":
        stages.check_chain(parts, ranges, example)


def main(argv: list[str]) -> int:
    """Entry point of ``modelpar verify``; returns the exit code (0 PASS, 1 FAIL, 2 bad input)."""
    import tempfile

    import yaml

    from modelpar.launch import under_launcher
    from modelpar.plan_file import PlanFile, read_plan_file
    from modelpar.launch import run_command
    from modelpar.rank_outcome import run_rank_and_exit

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar verify")
    args = parse(p, argv)
    if args.run_dir:                             # a rank: the launcher's options and plan, nothing re-resolved
        d = Path(args.run_dir)
        args = parse(p, ["--config", str(d / "verify.yaml")])
        pf = read_plan_file(d / "plan.json")
        plan = pf.plan.validate(pf.plan.world_size)
        run_rank_and_exit(lambda: run_rank(args, plan, pf.local_batch_size), "modelpar verify")
    from modelpar.cli.options import global_batch_size_given

    given = given_fields(p, argv)
    args.global_batch_size = global_batch_size_given(args, given)     # a --plan file's, unless given
    plan, local = resolve_plan(args, given)
    local = local or args.local_batch_size or args.global_batch_size // plan.dp
    _check_before_launch(args, plan, local)
    if under_launcher():                         # started by the user's own torchrun
        run_rank_and_exit(lambda: run_rank(args, plan, local), "modelpar verify")
    if plan.world_size == 1:
        return run_rank(args, plan, local)
    # many nodes: the folder the ranks read must be on a filesystem every node sees (here: under the
    # current directory, as train's run folder is under --out-dir)
    d = Path(tempfile.mkdtemp(prefix="modelpar-verify-", dir="." if args.nnodes > 1 else None))
    opts = {k: v for k, v in args.as_dict().items() if k not in ("config", "__path__", "run_dir")}
    (d / "verify.yaml").write_text(yaml.safe_dump(opts))
    PlanFile(plan, args.global_batch_size, local, "modelpar verify").write(d / "plan.json")
    target = ["-m", "modelpar", "verify", "--run-dir", str(d.resolve())]
    if args.nnodes > 1:
        from modelpar.launch import multinode_commands
        print(f"plan: {plan.describe()} on {plan.world_size} rank(s); folder {d} (verify.yaml, plan.json) must be "
              f"on a filesystem every node sees")
        print(multinode_commands(target, nnodes=args.nnodes, nproc_per_node=plan.world_size // args.nnodes))
        return 0
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    code, msg = run_command(target, plan.world_size, threads=threads).report("modelpar verify")
    if msg:                                      # FAIL: 1; a crash: 1, named; an error on every rank: 2
        print(msg, file=sys.stderr)
    return code


def verify_main(argv: list[str]) -> int:
    """``main`` with bad input reported as ``modelpar verify: error: ...`` and exit code 2."""
    from modelpar.cli.args import report_errors

    return report_errors(main, argv, "modelpar verify")
