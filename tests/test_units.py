"""Tier 1: partitioning, data sharding, batch terms, placement (no process groups)."""

import pytest
import torch

from modelpar.models import build_cnn, build_gpt, build_mlp
from modelpar.parallel.compose import parallelize
from modelpar.parallel.mesh import MeshInfo
from modelpar.parallel.parts import balanced_partition, check_parts_order, get_model_parts
from modelpar.plan import ParallelPlan, plan_for_strategy
from modelpar.train.data import eval_shard, global_batch_slice, load_text_corpus
from modelpar.train.task import classification_loss, lm_loss
from modelpar.verify import compare, run_steps


def test_balanced_partition_is_optimal():
    costs = [5, 1, 1, 1, 1, 5, 2, 2]
    cuts = balanced_partition(costs, 3)
    bounds = [0, *cuts, len(costs)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    # brute force over all cut pairs
    best = min(max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
               for i in range(1, 7) for j in range(i + 1, 8))
    assert worst == best == 7


def test_global_batch_slices_cover_each_sample_once():
    seen = []
    for a in range(3):
        for r in range(4):
            s = global_batch_slice(24, accum_step=a, num_accum=3, dp_rank=r, dp_degree=4)
            seen.extend(range(s.start, s.stop))
    assert sorted(seen) == list(range(24))


def test_global_rows_read_only_the_rows_a_rank_runs():
    """`train` hands each rank the global batch as `GlobalRows`: the same samples as `global_batch`
    (bitwise), but a rank's slices are the only rows read from the data (before, every rank gathered
    every sample of the global batch each step: at 3,072 sequences of 4,096 tokens, 100 MB per rank)."""
    from modelpar.train.data import TensorBatches, TokenBatches

    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    tb = TokenBatches(data, 16)
    reads = []
    at = tb.at
    tb.at = lambda off: reads.append(len(off)) or at(off)
    xg, yg = tb.global_rows(seed=3, step=7, global_batch_size=24)
    x_all, y_all = TokenBatches(data, 16).global_batch(3, 7, 24)
    assert len(xg) == len(yg) == 24 and reads == []
    for a in range(3):                          # rank 2 of 4, 3 accumulation steps
        sl = global_batch_slice(24, accum_step=a, num_accum=3, dp_rank=2, dp_degree=4)
        assert torch.equal(xg[sl], x_all[sl]) and torch.equal(yg[sl], y_all[sl])
    assert reads == [2, 2, 2]                   # 2 rows per slice, x and y read together
    with pytest.raises(ValueError, match="contiguous slice"):
        xg[::2]
    images = TensorBatches(torch.randn(50, 3), torch.arange(50))
    xi, yi = images.global_rows(1, 2, 8)
    xa, ya = images.global_batch(1, 2, 8)
    assert torch.equal(xi[2:6], xa[2:6]) and torch.equal(yi[2:6], ya[2:6])


def test_eval_shard_no_double_count_case_c2():
    # 10 samples over 4 ranks: 3, 3, 2, 2 -- disjoint, complete, no padding
    sl = [eval_shard(10, r, 4) for r in range(4)]
    assert [s.stop - s.start for s in sl] == [3, 3, 2, 2]
    assert sorted(i for s in sl for i in range(s.start, s.stop)) == list(range(10))


def test_stdlib_corpus_description():
    train, val, info = load_text_corpus()
    assert info.num_files > 100 and info.train_bytes > 10 * info.val_bytes > 0
    assert train.dtype == torch.uint8 and len(info.files_sha256) == 64
    assert "site-packages" not in info.source


def test_model_forms():
    gpt = build_gpt("gpt-nano", seq_len=16)
    parts = get_model_parts(gpt)
    assert parts.form == "modulelist" and [n for n, _ in parts.pre] == ["embed"] and parts.num_blocks == 2
    check_parts_order(gpt, parts, torch.zeros(2, 16, dtype=torch.long))
    assert get_model_parts(build_mlp("mlp-small")).num_blocks == 3
    assert get_model_parts(build_cnn()).num_blocks == 4


def test_presets_build_on_meta_without_memory():
    m = build_gpt("gpt-70b", device="meta")
    assert m.cfg.num_params() > 70e9
    assert all(p.is_meta for p in m.parameters())


def test_placement_matches_one_device():
    """Layer placement in one process (all 'cpu' here) trains like the unsplit model."""
    model = build_gpt("gpt-nano", seq_len=16, n_layer=4)

    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        w = torch.randint(0, 256, (4, 17), generator=g)
        return w[:, :-1], w[:, 1:]
    kw = dict(loss_fn=lm_loss, batch_fn=batch_fn, steps=10, global_batch_size=4, local_batch_size=4,
              mesh=MeshInfo(mesh=None))
    ref = run_steps(model, ParallelPlan(), **kw)
    got = run_steps(model, plan_for_strategy("placement", 1, placement_devices=("cpu", "cpu", "cpu")), **kw)
    rep = compare("placement", ref, got)
    assert rep.passed, rep.failures


def test_placement_layout_balanced_by_parameters():
    model = build_mlp("mlp-large", device="meta")
    plan = plan_for_strategy("placement", 1, placement_devices=("meta", "meta"))
    pm = parallelize(model, plan, MeshInfo(mesh=None), loss_fn=classification_loss, device=torch.device("meta"))
    (d0, (a0, b0)), (d1, (a1, b1)) = pm.layout
    assert (a0, b1) == (0, 5) and b0 == a1
    # 10000x5000 alone outweighs the rest: the first segment is that one block
    assert b0 == 1


def test_placement_targets_go_to_the_heads_device():
    """Placement over two device types (found on an H100: ``("cpu", "cuda:0")`` failed at the loss with
    the targets on ``cpu``): the targets follow the output to the last segment's device. Here the last
    segment is ``meta``, whose ops check devices the way CUDA's do: loss and evaluation come out there."""
    model = build_gpt("gpt-nano", seq_len=16, n_layer=4)
    plan = plan_for_strategy("placement", 1, placement_devices=("cpu", "meta"))
    pm = parallelize(model, plan, MeshInfo(mesh=None), loss_fn=lm_loss, device=torch.device("cpu"))
    assert pm.target_device == torch.device("meta")
    w = torch.randint(0, 256, (2, 17))
    assert pm.evaluate(w[:, :-1], w[:, 1:]).device.type == "meta"
    plain = parallelize(build_gpt("gpt-nano", seq_len=16, n_layer=4), ParallelPlan(), MeshInfo(mesh=None),
                        loss_fn=lm_loss, device=torch.device("cpu"))
    assert plain.target_device == torch.device("cpu")


def test_activation_checkpointing_keeps_names_and_grads_case_c8():
    from modelpar.parallel.checkpointing import apply_ac

    model = build_mlp([8, 8, 8, 4])
    names = [n for n, _ in model.named_parameters()]
    apply_ac(list(model), mode="full")
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randn(3, 8)                      # input does not require grad
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow          # inductor compiles C++ in child processes
def test_compile_option_compiles_blocks_and_matches_eager(monkeypatch):
    """plan.compile: each block goes through torch.compile (dynamo records graphs), names unchanged,
    and 3 training steps match eager."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    # compile here, not in a pool of worker processes that each import torch (same kernels)
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    model = build_gpt("gpt-nano", seq_len=16)

    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        w = torch.randint(0, 256, (4, 17), generator=g)
        return w[:, :-1], w[:, 1:]
    kw = dict(loss_fn=lm_loss, batch_fn=batch_fn, steps=3, global_batch_size=4, local_batch_size=4,
              mesh=MeshInfo(mesh=None))
    ref = run_steps(model, ParallelPlan(), **kw)
    from torch._dynamo.utils import counters
    counters.clear()
    got = run_steps(model, ParallelPlan(compile=True), **kw)
    assert counters["stats"]["unique_graphs"] >= 1
    rep = compare("compile", ref, got)
    assert rep.passed, rep.failures
    assert set(got.state) == set(ref.state)


def test_guard_keeps_local_errors_and_names_comm_failures():
    """A local error that every rank hits (a bug, a bad storage) is reported as itself; only errors of
    a collective or the store become a 'collective failed' diagnosis."""
    import torch.distributed as dist

    from modelpar.train.health import _looks_like_comm_failure

    assert not _looks_like_comm_failure(RuntimeError("Attempted to access the data pointer on an invalid python storage."))
    assert not _looks_like_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert _looks_like_comm_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert _looks_like_comm_failure(dist.DistError("anything"))


def test_only_train_calibrates_by_itself(tmp_path, monkeypatch):
    """`--strategy auto` outside `modelpar train` (bench's auto row, verify, preflight) plans with the
    uncalibrated estimate on an uncalibrated machine; it never starts the ~40 s calibration."""
    import modelpar.calibrate as cal
    from modelpar.bench.runner import check_row, make_rows

    monkeypatch.setenv("MODELPAR_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "1")
    calls = []
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: calls.append(a))
    (spec,) = make_rows("gpt-nano", ["auto"], nproc=2, hybrid_nproc=4, global_batch_size=8, seq_len=0, warmup=1,
                        steps=1, threads=1, timeout_s=60)
    plan, _ = check_row(spec)
    assert plan.world_size == 2 and calls == [] and not (tmp_path / "none.json").exists()


def test_pipeline_refuses_parameters_the_model_holds_itself():
    """A ModuleList-form model with a zero-initialised parameter of its own (``self.pos``, added in its
    forward): its children in order reproduce its output at initialisation, but pipeline stages would
    never use or train ``pos``; refused by name (cut and planner alike)."""
    from modelpar.parallel.cut import cut_pipeline, pipeline_cut_refusal
    from modelpar.plan import ParallelPlan

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.pos = torch.nn.Parameter(torch.zeros(8))
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            x = self.embed(x) + self.pos
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model, x = Net(), torch.randn(3, 4)
    parts = get_model_parts(model, example_input=x)
    assert parts.form == "modulelist"           # the chain matches while pos is zero
    why = pipeline_cut_refusal(model, x)
    assert "['pos']" in why and "belong to the model itself" in why, why
    with pytest.raises(ValueError, match=r"\['pos'\]"):
        cut_pipeline(model, parts, ParallelPlan(pp=2, n_microbatches=2), x)
    del model.pos                                 # without it the same model cuts
    model.forward = lambda x: model.head(torch.nn.Sequential(*model.blocks)(model.embed(x)))
    assert pipeline_cut_refusal(model, x) == ""
