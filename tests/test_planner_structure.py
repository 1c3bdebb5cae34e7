"""The planner core's structure: the device kind is a field (not a name test), one explicit cache per
search (no module-level memo tables), and one `runtime_layout` shared by the runtime and the models."""

import dataclasses
import json

import pytest

from modelpar.planner.hardware import BUILTIN, cpu_profile, get_hardware, load_profile, save_profile


def test_device_kind_is_a_field_set_by_presets_and_loads(tmp_path):
    assert cpu_profile(2).kind == "cpu"
    assert {hw.kind for hw in BUILTIN.values()} == {"gpu"}
    # a profile saved before the field existed (no "kind"): named "cpu" -> cpu, anything else -> gpu
    for name, kind in (("cpu", "cpu"), ("my-gpu", "gpu")):
        d = {k: v for k, v in cpu_profile(2).to_dict().items() if k != "kind"}
        d.update(name=name, schema_version=2)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        assert load_profile(p).kind == kind
    # saved with the field: round trip, and the kind (not the name) is what is read back
    hw = dataclasses.replace(cpu_profile(1), name="my-host")
    out = tmp_path / "host.json"
    save_profile(hw, out)
    assert json.loads(out.read_text())["kind"] == "cpu" and load_profile(out) == hw
    with pytest.raises(ValueError, match="kind='tpu' is unknown; valid: cpu, gpu"):
        dataclasses.replace(hw, kind="tpu")


def test_models_switch_on_the_kind_not_the_name():
    """A CPU profile under another name keeps every CPU behaviour: the same ranked plans and numbers,
    and the CLI's default precision."""
    from helpers.profiles import shared_profile_for as profile_for
    from modelpar.cli.common import precision_for
    from modelpar.planner.search import search_plans

    prof, _ = profile_for("gpt-nano", {}, 16, "fp32")
    hw = get_hardware("cpu", local_ranks=4)
    renamed = dataclasses.replace(hw, name="my-host")
    a = search_plans(prof, 4, hw, global_batch_size=8, precision="fp32")
    b = search_plans(prof, 4, renamed, global_batch_size=8, precision="fp32")
    assert [(c.plan, c.memory, c.step) for c in a.ranked] == [(c.plan, c.memory, c.step) for c in b.ranked]
    assert precision_for("", renamed) == "fp32" and precision_for("", BUILTIN["H100-80GB-SXM"]) == "bf16"
    # and a "gpu" kind under the name "cpu" is not treated as a CPU (the optimizer's CPU kernel terms)
    as_gpu = dataclasses.replace(hw, kind="gpu")
    c = search_plans(prof, 4, as_gpu, global_batch_size=8, precision="fp32")
    assert [x.step.optimizer for x in c.ranked] != [x.step.optimizer for x in a.ranked]


def _module_state():
    """Sizes of every module-level container and functools cache of the planner's modules."""
    import functools
    import importlib
    import pkgutil

    import modelpar.planner as pkg

    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"modelpar.planner.{info.name}")
        for name, val in vars(mod).items():
            if isinstance(val, (dict, list, set)):
                out[f"{info.name}.{name}"] = len(val)
            elif isinstance(val, functools._lru_cache_wrapper) and val.__module__ == mod.__name__:
                out[f"{info.name}.{name}()"] = val.cache_info().currsize
    return out


def test_a_search_leaves_no_module_level_memo_state():
    """Every memo table lives in the search's `PlannerCache`: a search and the estimates leave the
    planner modules' containers as they were (the old id()-keyed tables grew here)."""
    from modelpar.cli.common import profile_for
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import estimate_memory
    from modelpar.planner.search import search_plans

    prof, _ = profile_for("gpt-nano", {}, 16, "bf16")
    hw = BUILTIN["H100-80GB-SXM"]
    before = _module_state()
    rep = search_plans(prof, 8, hw, global_batch_size=16)
    top = rep.ranked[0]
    step = estimate_step(prof, top.plan, top.batch, hw)
    mem = estimate_memory(prof, top.plan, top.batch, overhead_bytes=hw.framework_overhead_bytes, foreach=True)
    assert _module_state() == before
    assert step.total == pytest.approx(top.step.total, rel=1e-12)
    assert mem.total == pytest.approx(top.memory.total, rel=1e-12)
    assert len(rep.ranked) > 10


def test_a_cache_serves_one_profile_and_one_hardware():
    from modelpar.cli.common import profile_for
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memo import PlannerCache
    from modelpar.planner.memory import Batch
    from modelpar.plan import ParallelPlan

    prof, _ = profile_for("gpt-nano", {}, 16, "bf16")
    other, _ = profile_for("gpt-nano", {}, 16, "bf16")
    plan = ParallelPlan(dp_shard=2, precision="bf16")
    cache = PlannerCache()
    a = estimate_step(prof, plan, Batch(8, 4), BUILTIN["H100-80GB-SXM"], cache=cache)
    assert estimate_step(prof, plan, Batch(8, 4), BUILTIN["H100-80GB-SXM"], cache=cache) == a
    assert cache.load_times and cache.comms and all(isinstance(k[0], tuple) for k in cache.load_times)
    with pytest.raises(ValueError, match="serves hardware 'H100-80GB-SXM', not 'A100-80GB'"):
        estimate_step(prof, plan, Batch(8, 4), BUILTIN["A100-80GB"], cache=cache)
    with pytest.raises(ValueError, match="serves another model profile"):
        estimate_step(other, plan, Batch(8, 4), BUILTIN["H100-80GB-SXM"], cache=cache)


# ---- runtime_layout: one decision for parallelize and the planner --------------------------------
from modelpar.plan import ParallelPlan, runtime_layout  # noqa: E402

LAYOUT_PLANS = [
    (ParallelPlan(), "none"),
    (ParallelPlan(dp_replicate=2), "ddp"),
    (ParallelPlan(dp_shard=2), "fsdp"),
    (ParallelPlan(dp_replicate=2, dp_shard=2), "hsdp"),
    (ParallelPlan(dp_replicate=2, tp=2), "replicate"),
    (ParallelPlan(dp_replicate=2, pp=2, n_microbatches=2), "replicate"),
    (ParallelPlan(dp_shard=2, pp=2, n_microbatches=2), "fsdp"),
]


def _applied_wrapper(pm) -> str:
    """The data-parallel wrapper a `ParallelModel` runs, read from its modules."""
    from torch.distributed._composable_state import _get_module_state
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(pm.wrapped, DistributedDataParallel):
        return "ddp"
    state = _get_module_state(pm.modules[0])
    if state is None:
        return "none"
    name = type(state).__name__
    if name == "_ReplicateState":
        return "replicate"
    assert name == "FSDPState", name
    return "hsdp" if type(state._fsdp_param_group.mesh_info).__name__ == "HSDPMeshInfo" else "fsdp"


@pytest.mark.parametrize("plan,wrapper", LAYOUT_PLANS, ids=lambda x: x.describe() if hasattr(x, "describe") else x)
def test_parallelize_applies_the_runtime_layout(plan, wrapper):
    """In one process with a fake process group of the plan's world size (collectives are no-ops),
    `parallelize` wraps a tiny GPT with the wrapper `runtime_layout` names."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelpar.models import build_model
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh

    assert runtime_layout(plan).dp_wrapper == wrapper
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        model = build_model("gpt-nano")
        x = torch.zeros(2, model.cfg.seq_len, dtype=torch.long)
        pm = parallelize(model, plan, build_mesh(plan, torch.device("cpu")),
                         loss_fn=lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
                         device=torch.device("cpu"), example_input=x if plan.pp > 1 else None)
        assert _applied_wrapper(pm) == wrapper
    finally:
        dist.destroy_process_group()


def test_the_planner_charges_the_runtime_layout(monkeypatch):
    """The memory and step-time models read `runtime_layout`: told that a TP x dp_replicate plan
    runs DDP instead of FSDP2's replicate, they charge DDP's buckets (memory) and bucket timing."""
    from helpers.profiles import shared_profile_for as profile_for
    from modelpar.planner import cost, memory
    from modelpar.plan import RuntimeLayout

    prof, _ = profile_for("gpt-nano", {}, 16, "fp32")
    plan = ParallelPlan(dp_replicate=2, tp=2)
    # two local batches: the peak (the loss's backward, torch's loss_parallel under TP) comes after the
    # first local batch stored its gradients, which replicate holds in tensors of their own
    batch = memory.Batch(8, 2)
    hw = BUILTIN["H100-80GB-SXM"]
    mem = memory.estimate_memory(prof, plan, batch)
    step = cost.estimate_step(prof, plan, batch, hw)
    as_ddp = RuntimeLayout("ddp", ("dp_replicate",), False)
    monkeypatch.setattr(memory, "runtime_layout", lambda p: as_ddp)
    monkeypatch.setattr(cost, "runtime_layout", lambda p: as_ddp)
    ddp_mem = memory.estimate_memory(prof, plan, batch)
    ddp_step = cost.estimate_step(prof, plan, batch, hw)
    ld = memory.rank_loads(prof, plan, act_bytes=4)[0]
    # replicate: one group's fp32 reduce buffer, gradients of their own; DDP: 4 B/param of buckets
    # that are the gradients' storage
    assert mem.comm_buffers == pytest.approx(4 * max(ld.max_unit_params, ld.root_params)) and mem.grads > 0
    assert ddp_mem.comm_buffers == pytest.approx(4 * ld.params) and ddp_mem.grads == 0.0
    assert ddp_step.dp_comm != pytest.approx(step.dp_comm, rel=0.1)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_gpt_preset_profiled_short_equals_every_layer_profiled(prec):
    """`profile_for` profiles a built-in GPT deeper than `PROFILE_LAYERS` at that depth and repeats its
    steady layer (gpt-70b's 88 layers: ~1 s instead of ~20 s); the result equals profiling every
    layer, the autocast variant (bf16) and a tied head included."""
    import torch

    from modelpar.cli.common import PROFILE_LAYERS, profile_for
    from modelpar.models import build_model
    from modelpar.planner.profile import profile_model

    for cfg in ({"n_layer": PROFILE_LAYERS + 3}, {"n_layer": PROFILE_LAYERS + 2, "tie_embeddings": True}):
        short, _ = profile_for("gpt-1m", cfg, 0, prec)
        m = build_model("gpt-1m", device="meta", **cfg)
        full = profile_model(m, torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta"),
                             dtype=torch.bfloat16 if prec == "bf16" else torch.float32, autocast=prec == "bf16")
        assert short == full and len(short.blocks) == cfg["n_layer"] + 2
        assert (short.autocast is not None) == (prec == "bf16")
