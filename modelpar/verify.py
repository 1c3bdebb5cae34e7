"""Parity: does a parallel plan train exactly like one device?

`run_steps` trains a model for N steps under a plan (or on one process with the trivial plan) from
the given initial weights; `compare` checks the losses and final parameters against the reference
with the project's tolerance (README, "What correct means"):

- the loss at every step within ``loss_rtol`` (1e-5) relative;
- parameters: per element |delta| <= 1e-4 + 1e-4 |theta| and overall ||delta|| / ||theta|| <= 1e-5
  (AdamW turns rounding noise in near-zero-gradient elements into lr-sized steps, so an elementwise
  relative tolerance alone cannot hold); with SGD, elementwise |delta| <= 1e-5 |theta| + 1e-7;
- the logged global gradient norm (before clipping) at every step within ``norm_rtol`` (1e-5)
  relative (case C3: one norm over all shards and stages). AdamW is nearly blind to a constant
  factor on the gradient, so this is also what catches a wrong loss scale (case C4).

`compare_low_precision` is the bf16 check: every parameter and optimizer state is fp32 (the
master weights), and the loss is within 2% of the fp32 reference from a given step on.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from modelpar.parallel.compose import parallelize
from modelpar.parallel.mesh import MeshInfo, build_mesh
from modelpar.plan import ParallelPlan, gradient_accumulation_steps
from modelpar.train.data import global_batch_slice
from modelpar.train.gather import gather_full_state_dict
from modelpar.train.loop import reduce_loss
from modelpar.train.step import make_optimizer as _make_optimizer, train_step


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]      # full state dict on rank 0 ({} elsewhere)
    dtypes: dict[str, list[str]] = field(default_factory=dict)   # master-weight / optimizer-state dtypes
    eval_loss: float | None = None      # loss of batch_fn(steps) after training, through evaluate()


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    """`modelpar.train.step.make_optimizer` with verify's weight decay (0.01 on matrices)."""
    return _make_optimizer(params, name, lr=lr, weight_decay=0.01)


def run_steps(model: nn.Module | Callable[[], nn.Module], plan: ParallelPlan, *, loss_fn: Callable,
              batch_fn: Callable[[int], tuple],
              steps: int, global_batch_size: int, local_batch_size: int, optimizer: str = "adamw",
              lr: float = 1e-3, grad_clip: float = 0.0, device: torch.device | None = None,
              mesh: MeshInfo | None = None, tp_plan=None, loss_reduction: str = "mean",
              loss_parallel: bool | None = None, split_points=None, blocks=None, probe: Callable | None = None,
              check_unused_params: bool = True, sync_batchnorm: bool = False) -> RunResult:
    """Train a deep copy of ``model`` for ``steps`` steps under ``plan``; or, ``model`` a callable
    returning the model (not an ``nn.Module``), train the model it returns, which this function then
    owns: no copy is made and none of the model stays referenced here beyond what the parallel layout
    holds (a pipeline rank: its own stages), so the caller must keep no reference either.

    Args:
        batch_fn: ``step -> (inputs, targets)`` of the whole global batch (the same on every rank).
        mesh: from `build_mesh`; built from the plan when None.
        loss_reduction: ``"mean"`` (``loss_fn`` averages over its batch) or ``"sum"``; the reported
            loss of a step is then the mean, or the sum, over the whole global batch (as one device).
        loss_parallel: see `modelpar.parallel.compose.parallelize`.
        probe: called with the `ParallelModel` before the first step (tests attach hooks with it).
        check_unused_params, sync_batchnorm: see `modelpar.parallel.compose.parallelize`.

    Raises:
        ValueError: batch sizes that do not divide (global / (local x dp), local / micro-batches;
            case C5), raised on every rank before any work.
    """
    device = device or torch.device("cpu")
    model = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    accum = gradient_accumulation_steps(global_batch_size, local_batch_size, plan.dp)
    plan.validate(local_batch_size=local_batch_size)
    mesh = mesh if mesh is not None else build_mesh(plan, device)
    x0, _ = batch_fn(0)
    mb = local_batch_size // (plan.n_microbatches if plan.pp > 1 else 1)
    pm = parallelize(model, plan, mesh, loss_fn=loss_fn, device=device, example_input=x0[:mb], tp_plan=tp_plan,
                     loss_reduction=loss_reduction, loss_parallel=loss_parallel, split_points=split_points, blocks=blocks,
                     check_unused_params=check_unused_params, sync_batchnorm=sync_batchnorm)
    del model                          # under a pipeline the root holds every stage's modules
    if probe is not None:
        probe(pm)
    opt = make_optimizer(pm.parameters(), optimizer, lr)
    if pm.mesh.mesh is not None:      # collective check; the one-process reference needs none
        from modelpar.train.preflight_checks import install_first_step_checks

        # cases C1/C8/C9: one error naming parameters without a gradient, before DDP's own at step 2
        install_first_step_checks(pm.named_parameters(), opt)
    losses, norms = [], []
    # a sum loss over the global batch is the sum of the local-batch sums; reduce_loss averages them
    loss_factor = plan.dp * accum if loss_reduction == "sum" else 1
    for step in range(steps):
        xg, yg = batch_fn(step)
        loss_sum, n, gnorm = train_step(pm, opt, xg, yg, accum_steps=accum, grad_clip=grad_clip, need_norm=True)
        losses.append(reduce_loss(pm, loss_sum, n, device) * loss_factor)
        norms.append(gnorm.item())
    eval_loss = 0.0                     # the next global batch through the evaluation path
    for a in range(accum):
        sl = global_batch_slice(batch_size_of(batch_fn(steps)), accum_step=a, num_accum=accum,
                                dp_rank=pm.mesh.dp_rank, dp_degree=plan.dp)
        xe, ye = batch_fn(steps)
        pm.train(False)
        le = pm.evaluate(xe[sl], ye[sl])
        pm.train(True)
        eval_loss += reduce_loss(pm, le.item() if le is not None else 0.0, 1 if le is not None else 0, device)
    eval_loss = eval_loss * plan.dp if loss_reduction == "sum" else eval_loss / accum
    dtypes = {"params": sorted({str(_local(p).dtype) for p in pm.parameters()}),
              "optimizer_state": sorted({str(_local(v).dtype) for st in opt.state.values()
                                         for k, v in st.items() if torch.is_tensor(v) and k != "step"})}
    return RunResult(losses, norms, gather_full_state_dict(pm), dtypes, eval_loss)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the names, shapes, dtypes and bytes of ``model``'s state dict (parameters and
    buffers): equal digests mean bitwise-equal initial weights (CPU tensors)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):     # a module's extra state
            h.update(f"{name}:{t!r};".encode())
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        # flat first: a 0-dim buffer (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def batch_size_of(batch) -> int:
    return len(batch[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class ParityReport:
    name: str
    passed: bool
    max_loss_rel_diff: float
    max_param_abs_diff: float
    max_param_excess: float              # max over elements of |delta| / (atol + rtol |theta|); <= 1 passes
    param_rel_norm_diff: float           # ||delta|| / ||theta||
    max_grad_norm_rel_diff: float
    loss_diffs: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"{self.name:34s} {'PASS' if self.passed else 'FAIL'}  loss rel {self.max_loss_rel_diff:.2e}  "
                f"param abs {self.max_param_abs_diff:.2e}  param rel-norm {self.param_rel_norm_diff:.2e}  "
                f"grad-norm rel {self.max_grad_norm_rel_diff:.2e}")


def compare(name: str, ref: RunResult, got: RunResult, *, optimizer: str = "adamw", loss_rtol: float = 1e-5,
            atol: float = 1e-4, rtol: float = 1e-4, norm_rtol: float = 1e-5, sgd_rtol: float = 1e-5,
            grad_norm_rtol: float = 1e-5) -> ParityReport:
    """Compare a parallel run with the one-process reference (see the module docstring)."""
    fails = []
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, got.losses)]
    if len(ref.losses) != len(got.losses) or any(math.isnan(x) for x in got.losses):
        fails.append(f"losses differ in length or are NaN: {got.losses}")
    max_loss = max(diffs) if diffs else float("inf")
    if max_loss > loss_rtol:
        fails.append(f"loss differs by {max_loss:.2e} relative (> {loss_rtol:.0e}) at step {diffs.index(max_loss)}")
    gn = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.grad_norms, got.grad_norms)]
    if set(ref.state) != set(got.state):
        fails.append(f"parameter names differ: only in reference {sorted(set(ref.state) - set(got.state))[:5]}, "
                     f"only in parallel {sorted(set(got.state) - set(ref.state))[:5]}")
    max_abs, max_excess, dsq, tsq = 0.0, 0.0, 0.0, 0.0
    for k in sorted(set(ref.state) & set(got.state)):
        a, b = ref.state[k].double(), got.state[k].double()
        if a.shape != b.shape:
            fails.append(f"{k}: shape {tuple(b.shape)} != reference {tuple(a.shape)}")
            continue
        d = (a - b).abs()
        max_abs = max(max_abs, d.max().item() if d.numel() else 0.0)
        if optimizer == "sgd":
            excess = (d / (sgd_rtol * a.abs() + 1e-7)).max().item() if d.numel() else 0.0
        else:
            excess = (d / (atol + rtol * a.abs())).max().item() if d.numel() else 0.0
        if excess > 1:
            fails.append(f"{k}: elementwise difference {d.max().item():.2e} beyond tolerance (x{excess:.2f})")
        max_excess = max(max_excess, excess)
        dsq += d.pow(2).sum().item()
        tsq += a.pow(2).sum().item()
    rel_norm = math.sqrt(dsq) / max(math.sqrt(tsq), 1e-12)
    if optimizer != "sgd" and rel_norm > norm_rtol:
        fails.append(f"||delta||/||theta|| = {rel_norm:.2e} > {norm_rtol:.0e}")
    if ref.eval_loss is not None and got.eval_loss is not None:
        ed = abs(ref.eval_loss - got.eval_loss) / max(abs(ref.eval_loss), 1e-12)
        if not ed <= loss_rtol:
            fails.append(f"evaluation loss after training differs by {ed:.2e} relative (> {loss_rtol:.0e}): "
                         f"{got.eval_loss:.6g} vs reference {ref.eval_loss:.6g}")
    max_gn = max(gn) if gn else 0.0
    if max_gn > grad_norm_rtol:
        fails.append(f"logged grad norm differs by {max_gn:.2e} relative (> {grad_norm_rtol:.0e}) at step "
                     f"{gn.index(max_gn)}: {got.grad_norms[gn.index(max_gn)]:.6g} vs reference "
                     f"{ref.grad_norms[gn.index(max_gn)]:.6g}")
    return ParityReport(name, not fails, max_loss, max_abs, max_excess, rel_norm, max_gn, diffs, fails[:10])


def compare_low_precision(name: str, ref: RunResult, got: RunResult, *, first_step: int = 20,
                          loss_rtol: float = 0.02) -> ParityReport:
    """bf16 run against the fp32 reference: fp32 master weights and optimizer state (asserted from
    ``got.dtypes``), and |loss - ref| / ref <= ``loss_rtol`` at every step from ``first_step`` on."""
    fails = []
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, got.losses)]
    window = diffs[first_step:]
    if len(ref.losses) != len(got.losses) or not window or any(math.isnan(x) for x in got.losses):
        fails.append(f"need {first_step + 1}+ steps of finite losses, got {got.losses}")
    max_loss = max(window) if window else float("inf")
    if max_loss > loss_rtol:
        fails.append(f"bf16 loss differs by {max_loss:.2e} relative (> {loss_rtol}) at step "
                     f"{first_step + window.index(max_loss)}")
    for kind in ("params", "optimizer_state"):
        if got.dtypes.get(kind) != ["torch.float32"]:
            fails.append(f"master {kind} dtypes are {got.dtypes.get(kind)}, expected only torch.float32")
    low = sorted(k for k, v in got.state.items() if v.is_floating_point() and v.dtype != torch.float32)
    if low:
        fails.append(f"saved parameters not fp32: {low[:5]}")
    abs_d = max((((ref.state[k].double() - got.state[k].double()).abs().max().item())
                 for k in set(ref.state) & set(got.state)), default=0.0)
    gn = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.grad_norms, got.grad_norms)]
    return ParityReport(name, not fails, max_loss, abs_d, 0.0, 0.0, max(gn) if gn else 0.0, diffs, fails)


def check_same_initial_weights(model: nn.Module, name: str) -> None:
    """Refuse, on every rank alike, a model the ranks built with different initial weights (a factory
    that does not seed itself): under FSDP, TP or a pipeline each rank keeps its own part of its own
    build, so the model trained would be no model's weights, and tied copies on different pipeline
    stages would start apart. One collective over the default process group: per floating-point
    tensor of the state dict, the float64 sum of its first 1,024 elements (two random initialisations
    differ there), min- and max-reduced over the ranks (on the current CUDA device under NCCL). Call it on every rank at the same point, after the model is built and before it is
    parallelised; a model on the meta device has no values to compare (skip it).

    Raises:
        ValueError: a tensor whose sums differ between ranks (the first one named).
    """
    import torch.distributed as dist

    named = [(k, t) for k, t in model.state_dict().items()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not named or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fp = torch.stack([t.detach().reshape(-1)[:1024].double().sum() for _, t in named]).nan_to_num()
    if dist.get_backend() == "nccl":
        fp = fp.to(torch.device("cuda", torch.cuda.current_device()))
    lo, hi = fp.clone(), fp.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    bad = (lo != hi).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"--model {name!r}: the ranks built different initial weights ({len(bad)} of {len(named)} "
                         f"tensors differ, first {named[bad[0]][0]!r}); a factory must seed itself "
                         f"(torch.manual_seed inside it) so that every call builds the same model (docs/your-model.md)")
