"""`modelpar verify`: does my model train under this plan exactly as on one process?

Trains N steps of a built-in model, or of the user's own model given as ``module:factory``, under a
parallel plan on ``plan.world_size`` local ranks, and the same steps on one process from the same
initial weights; prints the per-step loss differences, the largest parameter difference and
PASS / FAIL against the project's tolerance (`modelpar.verify.compare`), and on FAIL the likely
reason where the model has one (BatchNorm, dropout). Exit code 0 on PASS, 1 on FAIL, 2 on bad input
(also an error every rank raised, e.g. rank-divergent parameter use, case C12), 1 when a rank
crashed (named with its first error line; `modelpar.rank_outcome`).

The user factory is called with no arguments on every rank and returns either

- an ``nn.Module`` taking a float tensor ``(batch, *input_shape)`` and returning class logits
  ``(batch, classes)``; inputs are drawn N(0, 1) and labels uniformly (shapes from
  ``--input-shape`` / ``--num-classes``, or from the first and last ``nn.Linear``), loss = cross
  entropy; or
- a dict with ``model`` and optionally ``batch_fn`` (``step -> (inputs, targets)`` of the whole
  global batch, the same on every rank), ``loss_fn`` (``(output, target) -> scalar``) and
  ``loss_reduction`` (``"mean"`` or ``"sum"``).

The factory must build the same initial weights on every call (seed inside it). Dropout must be 0:
layouts with dropout on differ by design (see docs/parallelism.md, "Seeds").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

EXAMPLES = """examples:
  modelpar verify --model gpt-nano --plan '{"pp": 2, "n_microbatches": 2}'
  modelpar verify --model gpt-nano --strategy fsdp+tp --nproc 4 --steps 5
  modelpar verify --model mypkg.models:make_model --plan plan.json --input-shape 32 --num-classes 10
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modelpar verify", description=__doc__.split("\n\n")[1],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-nano", help="built-in model name, or module:factory for your own")
    p.add_argument("--plan", default=None, help="ParallelPlan as JSON text or a .json file path")
    p.add_argument("--strategy", default=None, help="strategy shorthand instead of --plan (ddp, fsdp, tp, pp, "
                                                    "hsdp, ddp+tp, fsdp+tp)")
    p.add_argument("--nproc", type=int, default=2, help="ranks for --strategy (a --plan sets its own)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--local-batch-size", type=int, default=0, help="samples per forward/backward per "
                                                                  "data-parallel rank (0: global / dp)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample for GPT models")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=0.0, help="global L2 clip norm (0: off)")
    p.add_argument("--input-shape", default=None, help="user model: per-sample input shape, e.g. 32 or 3,8,8")
    p.add_argument("--num-classes", type=int, default=0, help="user model: classes of its output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report to this file")
    p.add_argument("--no-check-unused-params", dest="check_unused_params", action="store_false",
                   help="skip the per-step check that data-parallel ranks used the same parameters (C12)")
    p.add_argument("--sync-batchnorm", action="store_true", help="BatchNorm -> SyncBatchNorm over the "
                                                                "data-parallel group (CUDA only; C15)")
    return p


def resolve_plan(args):
    """The plan of ``--plan`` (JSON text or file) or ``--strategy``/``--nproc``.

    Raises:
        ValueError: neither or both given, bad JSON, unknown fields.
    """
    from modelpar.plan import ParallelPlan, plan_for_strategy

    if (args.plan is None) == (args.strategy is None):
        raise ValueError("give exactly one of --plan (JSON or file) and --strategy")
    if args.strategy is not None:
        return plan_for_strategy(args.strategy, args.nproc)
    text = args.plan if args.plan.lstrip().startswith("{") else Path(args.plan).read_text()
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--plan is neither a file nor valid JSON: {e}") from None
    return ParallelPlan.from_dict(d).validate()


def load_task(args):
    """``(model, batch_fn, loss_fn, loss_reduction, description)`` for ``--model``; the same on every rank.

    Raises:
        ValueError: unknown built-in model, a factory that cannot be imported or returns something
            else than documented, or a user model whose input shape cannot be inferred.
    """
    import torch
    import torch.nn as nn

    from modelpar.models import MLP_PRESETS, PRESETS, build_model
    from modelpar.train.task import classification_loss, lm_loss

    gb = args.global_batch_size
    if ":" not in args.model:
        if args.model in PRESETS:
            model = build_model(args.model, seed=args.seed, seq_len=args.seq_len, dropout=0.0)

            def batch_fn(step):
                g = torch.Generator().manual_seed(args.seed * 100003 + step)
                w = torch.randint(0, model.cfg.vocab_size, (gb, args.seq_len + 1), generator=g)
                return w[:, :-1], w[:, 1:]
            return model, batch_fn, lm_loss, "mean", args.model
        model = build_model(args.model, seed=args.seed)       # raises ValueError listing the names
        shape = (MLP_PRESETS[args.model][0],) if args.model in MLP_PRESETS else (1, 8, 8)
        classes = MLP_PRESETS[args.model][-1] if args.model in MLP_PRESETS else 10
        return model, _random_batches(shape, classes, gb, args.seed), classification_loss, "mean", args.model
    mod_name, fn_name = args.model.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {args.model!r}: cannot load {fn_name} from module {mod_name}: {e}") from None
    made = factory()
    spec = made if isinstance(made, dict) else {"model": made}
    model = spec.get("model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {args.model!r}: the factory must return an nn.Module or a dict with 'model', "
                         f"got {type(made).__name__}")
    batch_fn = spec.get("batch_fn")
    if batch_fn is None:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        shape = (tuple(int(s) for s in args.input_shape.split(",")) if args.input_shape
                 else (linears[0].in_features,) if linears else None)
        classes = args.num_classes or (linears[-1].out_features if linears else 0)
        if shape is None or classes < 1:
            raise ValueError(f"--model {args.model!r}: give --input-shape and --num-classes, or return a "
                             f"'batch_fn' from the factory (no nn.Linear to infer them from)")
        batch_fn = _random_batches(shape, classes, gb, args.seed)
    return (model, batch_fn, spec.get("loss_fn", classification_loss), spec.get("loss_reduction", "mean"),
            f"{type(model).__name__} from {args.model}")


def _random_batches(shape, classes: int, gb: int, seed: int):
    import torch

    def batch_fn(step):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        return torch.randn(gb, *shape, generator=g), torch.randint(0, classes, (gb,), generator=g)
    return batch_fn


def format_report(desc: str, plan, world: int, rep, ref, got, hints: list[str] = ()) -> str:
    lines = [f"modelpar verify: {desc}, plan {plan.describe()} on {world} rank(s) vs 1 process, "
             f"{len(ref.losses)} steps",
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


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_rank(args, plan) -> int:
    """What every rank runs; rank 0 also runs the one-process reference and prints the report."""
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import MeshInfo, init_distributed
    from modelpar.plan import ParallelPlan
    from modelpar.verify import compare, run_steps

    rank, world = init_distributed(timeout_s=120)
    torch.set_num_threads(1 if world > 1 else max(1, os.cpu_count() or 1))
    model, batch_fn, loss_fn, reduction, desc = load_task(args)
    local = args.local_batch_size or args.global_batch_size // plan.dp
    kw = dict(loss_fn=loss_fn, batch_fn=batch_fn, steps=args.steps, global_batch_size=args.global_batch_size,
              optimizer=args.optimizer, lr=args.lr, grad_clip=args.grad_clip, loss_reduction=reduction)
    got = run_steps(model, plan, local_batch_size=local, check_unused_params=args.check_unused_params,
                    sync_batchnorm=args.sync_batchnorm, **kw)
    code = 0
    if rank == 0:
        ref = run_steps(model, ParallelPlan(), local_batch_size=args.global_batch_size,
                        mesh=MeshInfo(mesh=None), **kw)
        rep = compare(desc, ref, got, optimizer=args.optimizer)
        from modelpar.parallel.layer_checks import parity_hints

        print(format_report(desc, plan, world, rep, ref, got, parity_hints(model)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**rep.to_dict(), "plan": plan.to_dict(),
                                                   "ref_losses": ref.losses, "losses": got.losses}, indent=1))
        code = 0 if rep.passed else 1
    if dist.is_initialized():
        box = [code]
        dist.broadcast_object_list(box, src=0)
        code = box[0]
    return code


def verify_main(argv: list[str]) -> int:
    """Entry point of ``modelpar verify``; returns the exit code (0 PASS, 1 FAIL, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        plan = resolve_plan(args)
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        from modelpar.plan import gradient_accumulation_steps

        local = args.local_batch_size or args.global_batch_size // plan.dp
        gradient_accumulation_steps(args.global_batch_size, local, plan.dp)
        plan.validate(plan.world_size, local_batch_size=local)
        if not _under_launcher():                # bad --model / plan fail here, before any process starts
            model = load_task(args)[0]
            if plan.tp > 1:                      # case C7: a split that does not divide
                from modelpar.parallel.tensor import derive_tp_plan, validate_tp_plan

                validate_tp_plan(model, derive_tp_plan(model), plan.tp)
            if plan.pp > 1:
                from modelpar.parallel.parts import get_model_parts

                plan.validate(plan.world_size, num_blocks=get_model_parts(model).num_blocks)
            from modelpar.parallel.batchnorm import check_sync_batchnorm
            from modelpar.parallel.mesh import get_device

            check_sync_batchnorm(args.sync_batchnorm, get_device().type, [model])    # case C15
    except ValueError as e:
        print(f"modelpar verify: error: {e}", file=sys.stderr)
        return 2
    if _under_launcher():                        # a launched rank (modelpar.rank_outcome)
        from modelpar.rank_outcome import run_rank_and_exit

        run_rank_and_exit(lambda: run_rank(args, plan), "modelpar verify")
    if plan.world_size == 1:
        return run_rank(args, plan)
    from modelpar.rank_outcome import launch as launch_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = ["--standalone", f"--nproc-per-node={plan.world_size}", "--max-restarts=0", "-m", "modelpar",
              "verify", *argv]
    if args.strategy is not None:                # the launched ranks get the resolved plan
        launch = launch[:6] + [a for a in _replace_strategy(argv, plan)]
    code, msg = launch_ranks(launch).report("modelpar verify")   # FAIL: 1; a crash: 1, named; an error: 2
    if msg:
        print(msg, file=sys.stderr)
    return code


def _replace_strategy(argv: list[str], plan) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--strategy", "--nproc"):
            skip = True
            continue
        if a.startswith(("--strategy=", "--nproc=")):
            continue
        out.append(a)
    return out + ["--plan", plan.to_json()]
