"""The planner and the runtime split pipelines the same way (`modelpar.stage_split`): the planner's
`loads.stage_ranges` on the profile `modelpar plan` uses equals the split `parallelize` builds by
default (`pipeline.planned_ranges` on the runtime's model parts and micro-batch), for every stage
count the model allows. Pure: no process starts."""

import pytest
import torch
import torch.nn as nn

from modelpar.plan import ParallelPlan
from modelpar.stage_split import split_blocks


def test_even_split_keeps_the_ends_on_the_first_and_last_stage():
    # 6 layers between embed and head over 4 stages: Megatron's k L // S cuts
    assert split_blocks([1.0] * 8, 4, ends=True, even=True) == [(0, 2), (2, 4), (4, 5), (5, 8)]
    assert split_blocks([5.0, 1.0, 1.0, 9.0], 2, ends=False, even=True) == [(0, 2), (2, 4)]


def test_balanced_split_adds_the_ends_costs_to_the_first_and_last_layer():
    # layers 4, 1, 1, 1 before a costly head (3): costs 4, 1, 1, 4 -> best max 5 with the cut after 2 layers
    assert split_blocks([0.0, 4.0, 1.0, 1.0, 1.0, 3.0], 2, ends=True, even=False) == [(0, 3), (3, 6)]
    assert split_blocks([0.0, 1.0, 1.0, 1.0, 1.0, 3.0], 2, ends=True, even=False) == [(0, 4), (4, 6)]
    assert split_blocks([50.0, 10.0, 2.0, 0.5, 0.005], 2, ends=False, even=False) == [(0, 1), (1, 5)]


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="3 pipeline stages but the model has only 2 blocks"):
        split_blocks([1.0] * 4, 3, ends=True, even=True)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        split_blocks([1.0] * 4, 0, ends=False, even=False)


class _Uneven(nn.Module):
    """No transformer facts, blocks found in a ModuleList of unequal Linears, an input and an output part."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 64)
        self.layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 512),
                                     nn.Linear(512, 64), nn.Linear(64, 64)])
        self.out = nn.Linear(64, 200)

    def forward(self, x):
        x = self.stem(x)
        for m in self.layers:
            x = torch.relu(m(x))
        return self.out(x)


def _planner_and_runtime(name):
    """(planner profile, runtime model, runtime micro-batch) as `modelpar plan` and `modelpar train` make them."""
    from helpers.profiles import shared_profile_for as profile_for
    from modelpar.planner.profile import default_blocks, profile_model
    if name == "uneven":
        model = _Uneven()
        x = torch.zeros(2, 8)
        return profile_model(model, x[:1], blocks=default_blocks(model)), model, x
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
        from helpers.hf_tiny import TINY

        from modelpar.models.hf import build_hf
        spec, cfg = TINY[name[3:]]
        prof, _ = profile_for(spec, cfg, 16, "fp32")
        model = build_hf(spec, cfg, dropout=0.0, seed=0)
        x = torch.zeros(2, 3, 8, 8) if name == "hf-vit" else torch.zeros(2, 16, dtype=torch.long)
        return prof, model, x
    from modelpar.models import MLP_PRESETS, build_model
    prof, _ = profile_for(name, {}, 0 if name in MLP_PRESETS else 64, "fp32")
    model = build_model(name, device="meta" if name == "mlp-large" else "cpu")
    dev = next(model.parameters()).device
    x = (torch.zeros(4, MLP_PRESETS[name][0], device=dev) if name in MLP_PRESETS
         else torch.zeros(2, 64, dtype=torch.long))
    return prof, model, x


@pytest.fixture
def runtime_profile_once(monkeypatch):
    """`planned_ranges` profiles a model without transformer facts on every call (`profile_model`:
    ~1 s for mlp-deep's 101 Linears under FakeTensorMode); its profile depends only on the model, its
    blocks and the example input, not on the stage count, so the calls of one test for every stage
    count share the first call's profile (the first call runs `profile_model` itself). Returns the
    number of profiles actually taken."""
    from modelpar.planner import profile as profile_mod
    real, memo, taken = profile_mod.profile_model, {}, [0]

    def once(model, example_input, **kw):
        key = (id(model), id(example_input), tuple((n, id(m)) for n, m in kw.get("blocks") or ()),
               repr(sorted((k, v) for k, v in kw.items() if k != "blocks")))
        if key not in memo:        # (the model and input kept alive: no other object takes their ids)
            taken[0] += 1
            memo[key] = (real(model, example_input, **kw), model, example_input, kw)
        return memo[key][0]
    monkeypatch.setattr(profile_mod, "profile_model", once)
    return taken


@pytest.mark.parametrize("name", ["gpt-1m", "gpt-nano", "mlp-small", "mlp-large", "mlp-deep",
                                  "hf-llama", "hf-gpt2", "hf-vit", "uneven"])
def test_planner_stage_ranges_equal_the_runtime_split(name, runtime_profile_once):
    from modelpar.parallel.parts import get_model_parts
    from modelpar.parallel.pipeline import planned_ranges
    from modelpar.planner.loads import stage_ranges
    prof, model, x = _planner_and_runtime(name)
    parts = get_model_parts(model, example_input=x if x.device.type != "meta" else None)
    off = len(prof.blocks) - parts.num_blocks
    assert off in (0, 2), (len(prof.blocks), parts.num_blocks)
    counts = sorted({*range(2, min(parts.num_blocks, 8) + 1), parts.num_blocks})
    # stage counts of every schedule family: pp, pp x v (interleaved), 2 pp (V-shaped)
    plans = [ParallelPlan(pp=2, n_microbatches=4, pp_schedule="zbvzerobubble"),
             ParallelPlan(pp=2, n_microbatches=4, pp_schedule="interleaved1f1b", virtual_stages=2)]
    # each count once: both plans have 4 stages, and the split of a count does not depend on the plan
    counts = sorted({*counts, *(p.num_stages for p in plans if p.num_stages <= parts.num_blocks)})
    seen = set()
    before = runtime_profile_once[0]
    for s in counts:
        planner = stage_ranges(prof, s)
        runtime = planned_ranges(model, parts, s, x)
        shifted = [(max(a - off // 2, 0), min(b - off // 2, parts.num_blocks)) for a, b in planner]
        assert runtime == shifted, (name, s, planner, runtime)
        seen.add(tuple(runtime))
    assert len(seen) == len(counts)
    # the runtime profiled the model once at most (a transformer: never), whatever the number of counts
    assert runtime_profile_once[0] - before <= 1, runtime_profile_once[0] - before


def test_the_split_follows_flops_where_the_old_even_split_did_not():
    """mlp-large: 50M of its 62.5M parameters in the first Linear; the planner used to price blocks
    [0, 2) / [2, 5) (even by count) while the runtime built [0, 1) / [1, 5) (by FLOPs)."""
    from modelpar.measure.runs import planner_boundaries
    from modelpar.planner.loads import stage_ranges
    prof, _, _ = _planner_and_runtime("mlp-large")
    assert stage_ranges(prof, 2) == [(0, 1), (1, 5)]
    assert planner_boundaries("mlp-large", ParallelPlan(pp=2, n_microbatches=2)) == (1,)


def test_parallelize_uses_the_planned_split_by_default(monkeypatch):
    """`parallelize`'s pipeline path calls `planned_ranges` unless boundaries or a cost kind are given."""
    import modelpar.parallel.compose as compose
    from modelpar.parallel import pipeline
    calls = []

    class Stop(Exception):
        pass

    def fake(model, parts, n, ex):
        calls.append(n)
        raise Stop

    monkeypatch.setattr(pipeline, "planned_ranges", fake)
    from modelpar.models import build_model
    from modelpar.parallel.mesh import MeshInfo
    plan = ParallelPlan(pp=2, n_microbatches=2)
    mesh = MeshInfo.__new__(MeshInfo)
    with pytest.raises(Stop):
        compose.parallelize(build_model("mlp-small"), plan, mesh, loss_fn=nn.functional.cross_entropy,
                            device=torch.device("cpu"), example_input=torch.zeros(2, 1000))
    assert calls == [2]


def test_the_planner_prices_a_plan_s_own_stage_boundaries():
    """`estimate --stage-boundaries` / a run folder's plan.json: priced at that split, not the default."""
    from modelpar.planner.loads import plan_stage_ranges, rank_loads
    prof, _, _ = _planner_and_runtime("mlp-large")
    own = ParallelPlan(pp=2, n_microbatches=2, stage_boundaries=(2,))
    assert plan_stage_ranges(prof, own) == [(0, 2), (2, 5)]
    assert plan_stage_ranges(prof, ParallelPlan(pp=2, n_microbatches=2)) == [(0, 1), (1, 5)]
    loads = rank_loads(prof, own, act_bytes=4)
    assert loads[0].params == sum(b.num_params for b in prof.blocks[:2])
    gpt, _, _ = _planner_and_runtime("gpt-1m")                  # embed + 4 layers + head: boundaries skip embed
    assert plan_stage_ranges(gpt, ParallelPlan(pp=2, n_microbatches=2, stage_boundaries=(1,))) == [(0, 2), (2, 6)]
    with pytest.raises(ValueError, match=r"stage_boundaries=\(4,\) must be 1 strictly increasing block indices in 1..3"):
        plan_stage_ranges(gpt, ParallelPlan(pp=2, n_microbatches=2, stage_boundaries=(4,)))
