"""The planner commands (plan, estimate, calibrate) and the rules baseline (calibrate launches 2 gloo ranks once)."""

import json

import pytest
import torch

from modelpar.calibrate.micro import EXTRA_ROUNDS
from modelpar.cli.calibrate import main as calibrate_main
from modelpar.cli.estimate import main as estimate_main
from modelpar.cli.plan import main as plan_main
from modelpar.planner.hardware import BUILTIN, cpu_profile, load_profile
from modelpar.planner.rules import rule_plan

# plan / estimate profile each model once per process (tests/conftest.py `shared_profile_for`)
pytestmark = pytest.mark.usefixtures("shared_profile_for")


def test_plan_main_prints_table_and_explain(capsys):
    assert plan_main(["--model", "gpt-nano", "--nproc", "2", "--global-batch-size", "8",
                      "--top", "3", "--explain", "1"]) == 0
    out = capsys.readouterr().out
    assert "candidates considered" in out and "GiB/dev" in out and "step time:" in out
    with pytest.raises(SystemExit):
        plan_main(["--help"])


def test_estimate_main_answers_fit(capsys):
    assert estimate_main(["--model", "gpt-1m", "--nproc", "2", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "ddp" in out and "yes: best plan" in out


@pytest.mark.parametrize("factory", ["lm_pipelined", "conv_classifier"])
def test_plan_and_estimate_take_every_factory_form(factory, capsys):
    """Both declared factory forms of docs/your-model.md: a language model (token ids of max_positions, not
    floats of its first Linear's width: an embedding lookup failed before) and a classifier that declares
    its shapes (refused before); its two blocks cap the pipeline's stages (the search raised "4 pipeline
    stages but the model has only 2 blocks" on the language model before). (docs' TinyLM, `lm`, adds its
    residuals in its own forward: no pipeline, see the next test.)"""
    model = f"helpers.lm_factory:{factory}"
    assert plan_main(["--model", model, "--nproc", "2", "--top", "3"]) == 0
    assert "candidates considered" in capsys.readouterr().out
    assert estimate_main(["--model", model, "--nproc", "2", "--strategy", "pp"]) == 0
    assert "pp2(1f1b" in capsys.readouterr().out


def test_no_pipeline_is_priced_for_a_factory_forward_a_cut_cannot_keep(capsys):
    """`helpers.lm_factory.TinyLM` adds each block's residual in its own forward, which a stage cut loses
    (train refuses its pipelines before launch): the search prices none of them (every pipeline layout
    pruned with the reason; `plan` ranked 21 before), ``plan --strategy pp`` and ``estimate`` of a
    pipeline say why, and the same model with the residual inside its blocks is priced as before."""
    from modelpar.cli.common import profile_for
    from modelpar.planner.search import search_plans

    glue, _ = profile_for("helpers.lm_factory:lm", {}, 0, "fp32")
    fine, _ = profile_for("helpers.lm_factory:lm_pipelined", {}, 0, "fp32")
    assert "residual" in glue.pipeline_refusal and fine.pipeline_refusal == ""
    hw = BUILTIN["H100-80GB-SXM"]
    rep = search_plans(glue, 4, hw, global_batch_size=16)
    assert rep.pruned["the model's forward cannot be cut into stages"] > 0
    assert rep.ranked and all(c.plan.pp == 1 for c in rep.ranked)
    assert any(c.plan.pp > 1 for c in search_plans(fine, 4, hw, global_batch_size=16).ranked)
    for main in (plan_main, estimate_main):
        with pytest.raises(ValueError, match="the pipeline stages chained differ from the whole forward"):
            main(["--model", "helpers.lm_factory:lm", "--nproc", "2", "--strategy", "pp"])
    assert plan_main(["--model", "helpers.lm_factory:lm", "--nproc", "2", "--top", "3"]) == 0
    assert "the model's forward cannot be cut into stages" in capsys.readouterr().out


def test_plan_refuses_a_factory_sequence_past_its_positions(capsys):
    with pytest.raises(ValueError, match=r"--seq-len 33 exceeds the max_positions=32 that --model "
                                         r"'helpers\.lm_factory:lm' declares"):
        plan_main(["--model", "helpers.lm_factory:lm", "--nproc", "2", "--seq-len", "33"])


def _prof(name):
    """fp32, batch 1, at the preset's seq_len; the repeated blocks profiled once (`helpers.profiles`)."""
    from helpers.profiles import gpt_profile

    return gpt_profile(name)[0]


def test_rules_follow_precedence():
    hw = cpu_profile(1)
    small = _prof("gpt-1m")
    assert rule_plan(small, 1, hw, global_batch_size=8)[0].world_size == 1
    plan, why = rule_plan(small, 4, hw, global_batch_size=8)
    assert plan.dp_replicate == 4 and "DDP" in why
    big = _prof("gpt-2b")
    plan, why = rule_plan(big, 8, BUILTIN["A100-40GB"], global_batch_size=8, precision="bf16")
    assert plan.dp_shard == 8 and "FSDP" in why
    mid = _prof("gpt-1b")            # 0.93B, 24 blocks: >= 2 per device on 4 devices -> pipeline
    plan, why = rule_plan(mid, 4, BUILTIN["A100-40GB"], global_batch_size=8, precision="bf16")
    assert plan.pp == 4 and "model parallel" in why
    with pytest.raises(ValueError, match="task"):
        rule_plan(small, 2, hw, global_batch_size=8, task="speech")
    # model parallel the model refuses: the other form, or FSDP (it picked tp / pp that train refuses)
    import dataclasses
    plan, _ = rule_plan(dataclasses.replace(mid, pipeline_refusal="no cut"), 4, BUILTIN["A100-40GB"],
                        global_batch_size=8, precision="bf16")
    assert plan.tp == 4 and plan.pp == 1
    plan, why = rule_plan(dataclasses.replace(mid, pipeline_refusal="no cut", tp_refusal="no TP plan"), 4,
                          BUILTIN["A100-40GB"], global_batch_size=8, precision="bf16")
    assert plan.dp_shard == 4 and "refuses -> FSDP" in why


@pytest.mark.timeout(300)        # two rounds of every term (`--rounds 2`): ~45-90 s quiet on 2 cores
@pytest.mark.slow
def test_calibrate_smoke(tmp_path, capsys):
    out = tmp_path / "hw.json"
    # two rounds (`--rounds 2`, the fewest that run the settling rules: extra compute rounds and the
    # ranks' agreement on extra in-context rounds, `collectives.tables_unsettled`; 3 rounds took ~99 s
    # here) of every term and collective size, the slowest terms on smaller grids and inputs (`--quick`):
    # this checks the command and its file end to end, not the numbers; what rounds do with their
    # measurements is tested in test_planner_accuracy_tools and test_calibration_rounds
    assert calibrate_main(["--out", str(out), "--nproc", "2", "--rounds", "2", "--quick"]) == 0
    hw = load_profile(out)
    assert hw.peak_flops["fp32"] > 1e8 and 0 < hw.intra_latency < 0.1 and hw.intra_bw > 1e6
    assert json.loads(out.read_text())["source"].startswith("calibrated")
    # every collective timed between compute segments too, never cheaper for a larger message
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        ctx = sorted(hw.calibration.collectives[op].in_context.items())
        assert len(ctx) >= 4 and all(v > 0 for _, v in ctx), (op, ctx)
        assert all(a[1] <= b[1] for a, b in zip(ctx, ctx[1:])), (op, ctx)
    assert json.loads(out.read_text())["schema_version"] == 6
    # compute kernels every rank at once / one alone (`modelpar.calibrate.contention`): every kernel
    # timed, ratios of positive thread-CPU times; the summary within the kernels' range
    from modelpar.calibrate.contention import CONTENTION_KERNELS
    terms = hw.calibration.compute_contention_terms
    assert set(terms) == set(CONTENTION_KERNELS) and all(v > 0 for v in terms.values())
    assert min(terms.values()) <= hw.calibration.compute_contention <= max(terms.values())
    assert 0 < hw.calibration.dispatch_overhead_s < 1e-3          # seconds per aten call of tiny blocks
    # the thin beyond-cache table, every layout, at the quick sizes (16 rows x 4 and 16 MiB)
    assert all(len(hw.calibration.matmul_thin[lay]) == 2 for lay in ("NT", "NN", "TN"))
    # every term measured in rounds, its spread recorded: compute, collectives between segments, the
    # framework differences
    c = hw.calibration
    assert 2 <= c.rounds <= 2 + EXTRA_ROUNDS
    for term in ("matmul_flops[256]", "attention_flops", "elementwise_bw", "op_overhead_s", "mem_bandwidth",
                 "mem_bandwidth_alone", "all_reduce.in_context[small]", "reduce_scatter.in_context[65536 KiB]",
                 "tp_linear_overhead_s", "fsdp_unit_overhead_s", "zero_bubble_backward_factor",
                 "compute_contention"):
        assert term in c.spread and c.spread[term] >= 0, term
    # both memory bandwidths (all ranks at once, one alone) are sampled in pairs between the collective
    # phases (`collectives.shared_bandwidth_sample`): spreads over several samples, never one sample's
    # 0; sharing the bus never makes a rank faster than alone by much
    assert c.spread["mem_bandwidth"] > 0 and c.spread["mem_bandwidth_alone"] > 0
    assert hw.mem_bandwidth < 1.5 * c.mem_bandwidth_alone
    assert "spread" in capsys.readouterr().out


PINNED = "tests/data/cal_pinned.json"


def _rows(out: str) -> list[str]:
    """The table rows of `modelpar plan` (rank, plan, numbers)."""
    return [l for l in out.splitlines() if l[:3].strip().isdigit()]


def test_plan_strategy_ranks_one_family_or_says_why(capsys):
    """Issue 13 item 1: `plan --strategy S` ranks only plans of S's family (`strategy_of`), in the same
    order and with the same numbers as the full ranking; a family with no feasible plan, and the
    strategies the planner does not rank, are explained."""
    from modelpar.plan import ParallelPlan, strategy_of

    assert [strategy_of(ParallelPlan(**d)) for d in ({}, {"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2},
            {"dp_shard": 2, "tp": 2}, {"pp": 2, "dp_replicate": 2}, {"placement_devices": ("cpu",)})] == \
        ["single", "fsdp", "hsdp", "fsdp+tp", "custom", "placement"]
    base = ["--model", "gpt-1m", "--nproc", "4", "--global-batch-size", "16", "--hardware", PINNED]
    assert plan_main(base + ["--top", "200"]) == 0
    every = [r.split(None, 1)[1] for r in _rows(capsys.readouterr().out)]
    assert plan_main(base + ["--top", "200", "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    fsdp = [r.split(None, 1)[1] for r in _rows(out)]
    assert fsdp and all(r.startswith("fsdp4") for r in fsdp) and "strategy fsdp only" in out
    assert fsdp == [r for r in every if r.startswith("fsdp4")]          # same order, same numbers
    assert plan_main(["--model", "gpt-nano", "--nproc", "4", "--strategy", "tp", "--hardware", PINNED]) == 1
    assert "no tp plan is feasible" in capsys.readouterr().out          # gpt-nano has 2 heads
    with pytest.raises(ValueError, match="nothing to rank: price that layout with --plan"):
        plan_main(base + ["--strategy", "custom"])
    with pytest.raises(ValueError, match="placement .* is not modelled by the planner"):
        plan_main(base + ["--strategy", "placement"])
    with pytest.raises(ValueError, match="unknown strategy 'zero'"):
        plan_main(base + ["--strategy", "zero"])


def test_plan_prices_exactly_a_plan_file(tmp_path, capsys):
    """`plan --plan FILE` prices the plan `plan --explain K --json` wrote with the numbers its ranking
    gave it, and writes the same plan file back with --json; --strategy rules prices the rules plan."""
    base = ["--model", "gpt-1m", "--global-batch-size", "16", "--hardware", PINNED]
    assert plan_main(base + ["--nproc", "4", "--top", "3"]) == 0
    third = _rows(capsys.readouterr().out)[2].split(None, 1)[1]
    assert plan_main(base + ["--nproc", "4", "--explain", "3", "--json"]) == 0
    f = tmp_path / "plan.json"
    f.write_text(capsys.readouterr().out)
    assert plan_main(base + ["--plan", str(f)]) == 0                    # world size from the file
    out = capsys.readouterr().out
    assert _rows(out)[0].split(None, 1)[1] == third and "one plan priced (plan file" in out
    assert plan_main(base + ["--plan", str(f), "--json"]) == 0
    back, sent = json.loads(capsys.readouterr().out), json.loads(f.read_text())
    assert {k: v for k, v in back.items() if k != "source"} == {k: v for k, v in sent.items() if k != "source"}
    with pytest.raises(ValueError, match="give --plan or --strategy, not both"):
        plan_main(base + ["--plan", str(f), "--strategy", "ddp"])
    with pytest.raises(ValueError, match="was made for global_batch_size=16"):
        plan_main(["--model", "gpt-1m", "--global-batch-size", "32", "--plan", str(f)])
    with pytest.raises(ValueError, match="does not equal the world size 2"):
        plan_main(base + ["--plan", str(f), "--nproc", "2"])          # the file's plan uses 4
    assert plan_main(base + ["--nproc", "4", "--strategy", "rules"]) == 0
    assert "one plan priced (rules:" in capsys.readouterr().out


def test_strategy_auto_prices_no_pipeline_a_factory_forward_cannot_keep():
    """`train --strategy auto`'s search (`train.auto.choose`) on the same factory model: the pipeline
    layouts are pruned with the reason, and the one it picks is not a pipeline."""
    from modelpar.train.auto import choose
    from modelpar.train.config import TrainConfig

    c = choose(TrainConfig(model="helpers.lm_factory:lm", hardware="A100-80GB", global_batch_size=16), 4,
               measure_if_missing=False)
    assert "the model's forward cannot be cut into stages" in c.reason and c.plan.pp == 1, c.reason


def test_strategy_auto_profiles_a_deep_gpt_short_and_chooses_the_same(monkeypatch):
    """`train --strategy auto` profiles a built-in GPT deeper than `PROFILE_LAYERS` at that depth (as
    `plan` does) and chooses exactly what the whole profile gives: plan, local batch, reason (the
    search's summary) and prediction."""
    import modelpar.planner as planner
    from modelpar.planner import profile_blocks
    from modelpar.train.auto import choose
    from modelpar.train.config import TrainConfig

    seen, real = [], planner.profile_model

    def spy(model, *a, **k):
        seen.append(model.cfg.n_layer)
        return real(model, *a, **k)

    monkeypatch.setattr(planner, "profile_model", spy)
    cfg = TrainConfig(model="gpt-1m", model_config={"n_layer": 7}, hardware="A100-80GB", global_batch_size=16,
                      precision="bf16")
    short = choose(cfg, 4, measure_if_missing=False)
    monkeypatch.setattr(profile_blocks, "PROFILE_LAYERS", 100)       # the whole model, as before
    whole = choose(cfg, 4, measure_if_missing=False)
    assert seen == [4, 7] and short == whole, (seen, short, whole)
