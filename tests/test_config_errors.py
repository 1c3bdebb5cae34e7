"""Bad configuration: one clear error before any process starts, naming the field and the numbers."""

import pytest
import torch.nn as nn

from modelpar.parallel.parts import get_model_parts
from modelpar.parallel.tensor import derive_tp_plan, validate_tp_plan
from modelpar.plan import ParallelPlan
from modelpar.train.config import TrainConfig
from modelpar.train.loop import preflight


def _pre(world=2, **kw):
    cfg = TrainConfig(**{"model": "gpt-nano", **kw})
    return preflight(cfg, world)


def test_tp_degree_not_dividing_heads():
    with pytest.raises(ValueError, match=r"tensor parallel degree 4 does not divide the number of attention heads n_head=2"):
        _pre(world=4, strategy="tp")


def test_tp_degree_not_dividing_hidden_case_c7():
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))
    with pytest.raises(ValueError, match=r"tensor parallel degree 2 does not divide 0\.out_features=5"):
        validate_tp_plan(model, derive_tp_plan(model), 2)
    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8))
    with pytest.raises(ValueError, match=r"degree 4 does not divide 0\.out_features=10"):
        validate_tp_plan(model, derive_tp_plan(model), 4)


def test_planner_never_proposes_a_tp_degree_a_split_width_refuses_case_c7():
    """Before: the planner read divisibility from a GPT's / HF config's facts only, so for a user's
    Linear chain with hidden 10 it ranked tp4 plans (and `estimate --strategy tp` priced Linear(4, 5) at
    TP 2) that the runtime then refuses."""
    import torch
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.legality import split_violations
    from modelpar.planner.profile import ModelProfile, profile_model
    from modelpar.planner.search import search_plans

    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8))
    prof = profile_model(model, torch.randn(2, 8))
    assert prof.tp_splits == (("0", "out_features", 10), ("2", "in_features", 10))
    assert ModelProfile.from_dict(prof.to_dict()) == prof
    rep = search_plans(prof, 4, get_hardware("cpu", local_ranks=4), global_batch_size=16)
    tps = {c.plan.tp for c in rep.ranked}
    assert 4 not in tps and 2 in tps, tps          # tp2 divides 10, tp4 does not
    assert rep.pruned["tp does not divide a split width of the TP plan"] > 0
    prof = profile_model(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4)), torch.randn(2, 4))
    assert split_violations(prof.tp_splits, 2) == ["0.out_features=5", "2.in_features=5"]


def test_estimate_refuses_a_tp_degree_a_split_width_refuses_case_c7(tmp_path, monkeypatch, capsys):
    from modelpar.cli import main

    (tmp_path / "c7_est.py").write_text(
        "import torch.nn as nn\n\ndef c7():\n    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["estimate", "--model", "c7_est:c7", "--strategy", "tp", "--nproc", "2", "--hardware", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "tensor parallel degree tp=2 does not divide 0.out_features=5, 2.in_features=5" in err, err


def test_world_size_not_product_of_degrees():
    with pytest.raises(ValueError, match=r"dp_replicate x dp_shard x tp x pp = 1 x 2 x 2 x 1 = 4 does not equal "
                                         r"the world size 2"):
        _pre(world=2, strategy="custom", dp_shard=2, tp=2)


def test_degrees_that_contradict_the_strategy_are_an_error():
    """Before: ``--strategy fsdp --tp 2`` silently ran a different layout (issue 13)."""
    with pytest.raises(ValueError, match=r"--strategy fsdp on 4 ranks sets tp=1, but --tp 2 was given"):
        _pre(world=4, strategy="fsdp", tp=2)
    with pytest.raises(ValueError, match=r"--strategy auto chooses the degrees itself, but --dp-shard 2"):
        _pre(world=2, strategy="auto", dp_shard=2)
    with pytest.raises(ValueError, match=r"strategy 'ddp\+tp' on 4 ranks sets dp_replicate=2, but 4 was given"):
        _pre(world=4, strategy="ddp+tp", dp_replicate=4, tp=2)
    plan, _ = _pre(world=4, strategy="fsdp+tp", tp=2)          # the shorthand's open axis: fine
    assert (plan.dp_shard, plan.tp) == (2, 2)


def test_every_plan_field_is_reachable_from_train_config():
    plan, _ = _pre(world=4, strategy="custom", layout={"dp_shard": 2, "tp": 2, "sequence_parallel": True})
    assert plan.sequence_parallel and plan.describe() == "fsdp2 x tp2+sp"
    plan, _ = _pre(world=2, strategy="fsdp", layout={"reshard_after_forward": False, "activation_checkpointing": "full"})
    assert (plan.dp_shard, plan.reshard_after_forward, plan.activation_checkpointing) == (2, False, "full")
    with pytest.raises(ValueError, match="layout has unknown ParallelPlan fields"):
        _pre(world=2, strategy="ddp", layout={"tp_degree": 2})
    with pytest.raises(ValueError, match="plan_options has unknown ParallelPlan fields"):   # the old form
        _pre(world=2, strategy="ddp", plan_options={"tp_degree": 2})


def test_more_stages_than_blocks():
    with pytest.raises(ValueError, match=r"4 pipeline stages but the model has only 2 blocks"):
        _pre(world=4, strategy="pp")


def test_batch_not_divisible_by_microbatches_case_c5():
    with pytest.raises(ValueError, match=r"local batch size 10 is not divisible by n_microbatches=4"):
        _pre(world=2, strategy="pp", global_batch_size=10, local_batch_size=10, n_microbatches=4)


def test_global_batch_not_divisible():
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by local_batch_size x "
                                         r"data-parallel degree = 4 x 2 = 8"):
        _pre(world=2, strategy="ddp", global_batch_size=10, local_batch_size=4)


def test_unknown_strategy_lists_valid():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero'; valid: single, placement, ddp, fsdp"):
        _pre(strategy="zero")


def test_unknown_schedule_lists_valid():
    with pytest.raises(ValueError, match=r"--pp-schedule 'fast' is unknown; valid: gpipe, 1f1b, interleaved1f1b"):
        _pre(strategy="pp", pp_schedule="fast")


def test_cpu_offload_without_cuda():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so cpu_offload is allowed")
    with pytest.raises(ValueError, match="cpu_offload=True"):
        _pre(strategy="fsdp", cpu_offload=True)


def test_unsplittable_model_names_the_forms():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x))
    # two different Linears, no container: nothing to cut at; the message names the options that exist
    for sp in (None, ["a", "b"]):
        with pytest.raises(ValueError, match=r"cannot find the blocks of Odd.*--blocks PATH.*--split-points A,B"):
            get_model_parts(Odd(), sp)


def test_plan_round_trips():
    p = ParallelPlan(dp_shard=2, tp=2, pp=2, pp_schedule="gpipe", n_microbatches=4, stage_boundaries=(2,))
    assert ParallelPlan.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown ParallelPlan fields"):
        ParallelPlan.from_dict({"tp_degree": 2})


def test_cli_error_before_launch(capsys):
    """The CLI (`modelpar.cli.main`, what ``python -m modelpar`` runs) exits 2 with the message and
    starts no process (the pure tier's guard would fail the test), so no process group either."""
    from modelpar.cli import main

    assert main(["train", "--model", "gpt-nano", "--strategy", "tp", "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert "does not divide the number of attention heads n_head=2" in err
    assert "torch.distributed.run" not in err and "Rendezvous" not in err


def test_missing_or_tiny_data_refused_before_launch(tmp_path):
    with pytest.raises(ValueError, match=r"--data '/nonexistent/corpus.txt' does not exist"):
        _pre(data="/nonexistent/corpus.txt", strategy="ddp")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    with pytest.raises(ValueError, match="too small"):
        _pre(data=str(tiny), strategy="ddp")


def test_global_batch_not_divisible_by_dp_names_user_fields():
    with pytest.raises(ValueError, match=r"global_batch_size=7 is not divisible by the data-parallel degree 2"):
        _pre(world=2, strategy="ddp", global_batch_size=7)


def test_other_commands_report_bad_input_in_one_line(capsys):
    from modelpar.cli import main

    assert main(["estimate", "--model", "gpt-7b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("modelpar estimate: error: unknown model 'gpt-7b'") and "Traceback" not in err


def test_pipeline_evaluation_needs_one_local_batch_of_validation_samples():
    """Under a pipeline `evaluate` runs whole local batches only: 8 validation samples under a local
    batch of 16 averaged nothing and printed 'validation loss nan -> nan' (found in session 11's
    walkthrough); now refused before launch."""
    cfg = dict(model="gpt-nano", strategy="pp", nproc=2, global_batch_size=16)
    with pytest.raises(ValueError, match=r"eval_samples=8 gives each of the 1 data-parallel rank\(s\) fewer "
                                         r"than one local batch \(16 samples\).*--eval-samples to >= 16"):
        preflight(TrainConfig(**cfg, eval_samples=8), 2)
    assert preflight(TrainConfig(**cfg, eval_samples=16), 2)[0].pp == 2
    assert preflight(TrainConfig(**{**cfg, "strategy": "ddp"}, eval_samples=8), 2)[0].pp == 1


@pytest.mark.parametrize("cmd", ["train", "plan", "estimate"])
def test_bad_model_config_json_and_zero_batch_name_the_flag(cmd):
    """--model-config that is not a JSON object says what JSON found (it printed jsonargparse's
    'Parser key "model_config": Expected a <class 'dict'>'), and --global-batch-size 0 names the flag in
    every command (plan / estimate said 'num_devices=2 and global_batch_size=0 must be >= 1')."""
    import importlib

    main = importlib.import_module(f"modelpar.cli.{cmd}").main
    with pytest.raises(ValueError, match=r"^--model-config must be a JSON object, e\.g\. .*\(JSON: Expecting "
                                         r"property name"):
        main(["--model", "gpt-nano", "--nproc", "2", "--model-config", "{bad json"])
    with pytest.raises(ValueError, match=r"^--global-batch-size must be >= 1, got 0$"):
        main(["--model", "gpt-nano", "--nproc", "2", "--global-batch-size", "0"])


def test_estimate_names_the_micro_batch_flag_when_the_batch_does_not_split():
    """`estimate --micro-batch-size 3` on a batch it does not split names the flags given (it said
    'local_batch_size x dp = 3 x 2', a name the user never typed), the micro-batch count under a pipeline."""
    from modelpar.cli.estimate import main

    with pytest.raises(ValueError, match=r"^--global-batch-size 16 is not a multiple of --micro-batch-size 3 x 2 "
                                         r"data-parallel rank\(s\) = 6"):
        main(["--model", "gpt-1m", "--nproc", "2", "--strategy", "fsdp", "--micro-batch-size", "3"])
    with pytest.raises(ValueError, match=r"--micro-batch-size 3 x 4 micro-batches x 1 data-parallel rank\(s\) = 12"):
        main(["--model", "gpt-1m", "--nproc", "2", "--strategy", "pp", "--micro-batch-size", "3"])


@pytest.mark.parametrize("world,argv,message", [
    (2, ["--strategy", "pp", "--pp-schedule", "foo"], r"^--pp-schedule 'foo' is unknown; valid: gpipe, 1f1b"),
    (2, ["--strategy", "ddp", "--optimizer", "lion"], r"^--optimizer 'lion' is unknown; valid: adamw"),
    # the blocks first (it named --eval-samples first, and only once that was raised, the blocks)
    (6, ["--strategy", "pp", "--global-batch-size", "12", "--eval-samples", "8"],
     r"^pp x virtual_stages = 6 x 1 = 6 pipeline stages but the model has only 2 blocks"),
    # a default n_microbatches (2 x pp) the user never set: the flags that fix it are named
    (4, ["--pp", "2", "--dp-shard", "2", "--global-batch-size", "4"],
     r"not divisible by n_microbatches=4 .*set --n-microbatches to a divisor of 2, or raise --global-batch-size"),
    # pipeline micro-batches without a pipeline: refused as --virtual-stages is (it was ignored, silently)
    (2, ["--strategy", "fsdp", "--n-microbatches", "4"],
     r"^--n-microbatches 4 splits a pipeline's local batch, but --strategy fsdp runs no pipeline \(pp=1\)"),
    (2, ["--dp-shard", "2", "--n-microbatches", "2"], r"^--n-microbatches 2 .* --strategy custom runs no pipeline"),
    (2, ["--strategy", "ddp", "--pp-schedule", "gpipe"],
     r"^--pp-schedule gpipe orders a pipeline's micro-batches, but --strategy ddp runs no pipeline \(pp=1\)"),
    (2, ["--strategy", "tp", "--no-reshard-after-forward"],
     r"^--no-reshard-after-forward sets what FSDP does .* --strategy tp shards no parameters \(dp_shard=1\)"),
    (2, ["--strategy", "ddp", "--activation-checkpointing", "full", "--ac-every", "2"],
     r"\(--ac-every 2 needs --activation-checkpointing every-k\)$"),
])
def test_train_names_the_flag_of_a_bad_value_first(world, argv, message):
    """A new user's report: errors named internal fields (``ParallelPlan.pp_schedule='foo'``,
    ``optimizer='lion'``) or a default the user never set, without the flag that changes it."""
    from modelpar.cli.train import parse_train_config
    from modelpar.train.resolve import resolve

    cfg, _, _ = parse_train_config(["--model", "gpt-nano", "--nproc", str(world), *argv])
    with pytest.raises(ValueError, match=message):
        preflight(cfg, world, resolve(cfg, world))


def test_plan_names_the_optimizer_flag(capsys):
    from modelpar.cli import main

    assert main(["plan", "--model", "gpt-nano", "--optimizer", "lion", "--nproc", "2"]) == 2
    assert "--optimizer 'lion' is unknown; valid: sgd, sgd_momentum, adamw" in capsys.readouterr().err


def test_estimate_says_how_to_split_a_batch_over_the_data_parallel_ranks(capsys):
    from modelpar.cli import main

    rc = main(["estimate", "--model", "gpt-nano", "--strategy", "ddp", "--nproc", "64", "--hardware", "H100-80GB-SXM"])
    err = capsys.readouterr().err
    assert rc == 2 and ("--global-batch-size 16 is not a multiple of the data-parallel degree 64" in err
                        and "give a --global-batch-size that is a multiple of 64, or fewer data-parallel ranks" in err), err


@pytest.mark.parametrize("model,strategy,nproc,way", [
    ("gpt-nano", "fsdp", 2, "add --meta-init"),
    ("helpers.lm_factory:lm", "fsdp", 2, "launch fewer ranks on this host (--nproc)"),
    ("gpt-nano", "ddp", 2, "--meta-init needs a layout that shards the parameters"),
    ("gpt-nano", "single", 1, "train a smaller model, or on hosts with more memory")])
def test_train_refuses_whole_model_builds_the_host_cannot_hold(tmp_path, monkeypatch, capsys, model, strategy, nproc,
                                                               way):
    """Without --meta-init every local rank builds the whole model on the host before sharding it
    (gpt-70b on 8 ranks: 2.3 TB): refused before launch, no run folder, naming the numbers and the way
    out, --meta-init only where the layout takes it (the host's available memory made tiny here). With
    --meta-init, only CPU ranks' training state is bounded (every replica holds each parameter, its
    gradient and AdamW's moments: 16 bytes)."""
    from modelpar.cli import main
    from modelpar.train import host_memory

    monkeypatch.setattr(host_memory, "host_memory_available", lambda: 1000)
    out = tmp_path / "runs"
    argv = ["train", "--model", model, "--strategy", strategy, "--nproc", str(nproc), "--steps", "1", "--seq-len",
            "16", "--global-batch-size", "4", "--out-dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    who = f"each of the {nproc} rank(s) on this host builds" if nproc > 1 else "the one process builds"
    assert len(err.splitlines()) == 1 and f"{who} the whole model" in err, err
    assert "GB available" in err and way in err, err
    assert not out.exists()
    from modelpar.train.task import build_task

    cfg = TrainConfig(model="gpt-nano", meta_init=True)     # each rank allocates its own shards only
    model = build_task(cfg, device="meta", load_data=False).model
    n = sum(p.numel() for p in model.parameters())
    host_memory.check_host_memory(cfg, ParallelPlan(dp_shard=2), model, 2, 1000, on_cpu=False)
    host_memory.check_host_memory(cfg, ParallelPlan(dp_shard=2), model, 2, 16 * n, on_cpu=True)
    with pytest.raises(ValueError, match=r"CPU ranks keep the training state in host memory: .* x 1 data-parallel"):
        host_memory.check_host_memory(cfg, ParallelPlan(dp_shard=2), model, 2, 16 * n - 1, on_cpu=True)


@pytest.mark.parametrize("sched", ["interleavedzerobubble", "zbvzerobubble", "dualpipev"])
def test_split_backward_schedules_under_fsdp_keep_parameters_gathered(sched):
    """Before: pp2 x fsdp2 with a zero-bubble / DualPipeV schedule trained with FSDP's default
    reshard_after_forward=True: the weight part (W) of a micro-batch's backward runs after later
    micro-batches' forwards have resharded the blocks, and the last stage's block got no gradient
    (zbv, interleaved ZB) or wrong ones (dualpipev: grad norm 2% off at step 0), silently."""
    from modelpar.cli.train import parse_train_config
    from modelpar.plan import fsdp_keeps_gathered
    from modelpar.train.resolve import resolve

    base = ["--model", "gpt-nano", "--model-config", '{"n_layer": 4}', "--nproc", "4", "--pp", "2",
            "--dp-shard", "2", "--pp-schedule", sched, "--virtual-stages", "2", "--n-microbatches", "4"]
    cfg, _, _ = parse_train_config(base)                  # unset: what the schedule needs
    assert resolve(cfg, 4).plan.reshard_after_forward is False
    cfg, _, _ = parse_train_config(base + ["--reshard-after-forward"])
    with pytest.raises(ValueError, match=rf"pp_schedule='{sched}' with FSDP \(dp_shard=2\) needs "
                                         r"reshard_after_forward=False \(--no-reshard-after-forward\)"):
        preflight(cfg, 4, resolve(cfg, 4))
    with pytest.raises(ValueError, match="--no-reshard-after-forward"):
        ParallelPlan(pp=2, dp_shard=2, pp_schedule=sched, virtual_stages=2, n_microbatches=4).validate(4)
    # a plan file or JSON text without the field: the same default as the flag unset
    partial = dict(pp=2, dp_shard=2, pp_schedule=sched, virtual_stages=2, n_microbatches=4)
    assert ParallelPlan.from_dict(partial).validate(4).reshard_after_forward is False
    with pytest.raises(ValueError, match="--no-reshard-after-forward"):
        ParallelPlan.from_dict(dict(partial, reshard_after_forward=True)).validate(4)
    # the schedules that run each backward whole, and data parallelism without sharding, keep the default
    for other in ("1f1b", "interleaved1f1b"):
        v = 2 if other == "interleaved1f1b" else 1
        assert not fsdp_keeps_gathered(2, 2, other)
        ParallelPlan(pp=2, dp_shard=2, pp_schedule=other, virtual_stages=v, n_microbatches=4).validate(4)
    ParallelPlan(pp=2, dp_replicate=2, pp_schedule=sched, virtual_stages=2, n_microbatches=4).validate(4)
    assert fsdp_keeps_gathered(2, 2, sched) and not fsdp_keeps_gathered(1, 2, sched)


def test_planner_plans_of_split_backward_schedules_under_fsdp_validate():
    """The planner's zero-bubble x FSDP plans are the ones the runtime can train (and priced so)."""
    import torch
    from modelpar.models import build_gpt
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.profile import profile_model
    from modelpar.planner.search import search_plans

    model = build_gpt("gpt-nano", seq_len=16, n_layer=4, seed=0)
    prof = profile_model(model, torch.zeros(2, 16, dtype=torch.long))
    rep = search_plans(prof, 4, get_hardware("cpu", local_ranks=4), global_batch_size=16)
    zb = [c.plan for c in rep.ranked if c.plan.pp > 1 and c.plan.dp_shard > 1
          and c.plan.pp_schedule in ("interleavedzerobubble", "zbvzerobubble")]
    assert zb
    for plan in zb:
        assert plan.reshard_after_forward is False
        plan.validate(4)


@pytest.mark.parametrize("argv,message", [
    (["train", "--seq-len", "-5"], "--seq-len must be >= 0, got -5"),
    (["plan", "--model", "gpt-1m", "--seq-len", "-5"], "--seq-len must be >= 0, got -5"),
    (["estimate", "--model", "gpt-1m", "--strategy", "ddp", "--micro-batch-size", "-2"],
     "--micro-batch-size must be >= 0, got -2"),
    (["train", "--eval-samples", "0"], "--eval-samples must be >= 1, got 0"),
    (["train", "--timeout-s", "0"], "--timeout-s must be > 0, got 0.0"),
    (["train", "--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["train", "--local-batch-size", "-8"], "--local-batch-size must be >= 0, got -8"),
    (["train", "--warmup-steps", "-5"], "--warmup-steps must be >= 0, got -5"),
    (["train", "--grad-clip", "-1"], "--grad-clip must be >= 0, got -1.0"),
    (["train", "--dropout", "1"], "--dropout must be >= 0 and < 1, got 1.0"),
    (["verify", "--model", "gpt-nano", "--strategy", "ddp", "--seq-len", "-3"], "--seq-len must be >= 0, got -3"),
    (["train", "--strategy", "ddp", "--hardware", "foo"], "unknown hardware 'foo'"),
    (["plan", "--model", "gpt-1m", "--hardware", "/no/such/cal.json"], "hardware file '/no/such/cal.json' does not exist"),
    (["train", "--strategy", "single", "--nproc", "2"], "--strategy single runs one process; --nproc 2 does not apply"),
    (["train", "--strategy", "fsdp+tp", "--nproc", "2"],
     "strategy 'fsdp+tp' needs nproc = dp_shard x tp with both >= 2 (tp=2), got nproc=2"),
    (["plan", "--model", "gpt-1m", "--strategy", "hsdp", "--nproc", "2"], "e.g. --strategy fsdp"),
    (["train", "--strategy", "pp", "--stage-boundaries", "1", "2"],
     "--stage-boundaries takes a JSON list in one argument, e.g. --stage-boundaries '[4,8]'"),
    (["train", "--strategy", "placement", "--placement-devices", "cpu", "cpu"], "--placement-devices takes a JSON list"),
    (["plan", "--model", "gpt-1m", "--explain", "-1"], "--explain must be >= 0, got -1"),
    # a second trial: a negative degree read as a batch error in train ("smaller than the data-parallel
    # degree -2"), a dataclass field name elsewhere; a --min-lr above --lr was taken
    (["train", "--dp-shard", "-2", "--nproc", "2"], "--dp-shard must be >= 1, got -2"),
    (["train", "--dp-shard", "3", "--nproc", "2"], "dp_replicate x dp_shard x tp x pp = 1 x 3 x 1 x 1 = 3 does "
                                                   "not equal the world size 2"),     # (was: the batch first)
    (["estimate", "--model", "gpt-1m", "--dp-shard", "0", "--nproc", "2"], "--dp-shard must be >= 1, got 0"),
    (["verify", "--model", "gpt-nano", "--tp", "-1", "--nproc", "2"], "--tp must be >= 1, got -1"),
    (["train", "--min-lr", "1"], "--min-lr 1.0 is above --lr 0.005"),
    # --split-points beside --stage-boundaries won silently (plan.json recorded the other); on ddp it was ignored
    (["train", "--strategy", "pp", "--split-points", "blocks.3", "--stage-boundaries", "[2]"],
     "--split-points blocks.3 and stage_boundaries=[2] (--stage-boundaries or the plan file's) both say where"),
    (["train", "--strategy", "ddp", "--split-points", "blocks.2"],
     "--split-points blocks.2 names the blocks that start pipeline stages; ddp2 runs no pipeline"),
    (["verify", "--model", "helpers.lm_factory:classifier", "--strategy", "ddp", "--input-shape", "3;4"],
     "--input-shape '3;4': one sample's shape as positive ints, e.g. --input-shape 3,32,32"),
])
def test_out_of_range_options_are_refused_in_one_line(capsys, argv, message):
    """A fresh user's trial: these ended in tracebacks inside the ranks (negative sizes, --timeout-s 0),
    after launch (--lr -1), or ran with the value taken silently (--warmup-steps -5, --hardware foo on a
    named strategy, fsdp+tp on 2 ranks as plain tp2, single on --nproc 2 as one process)."""
    from modelpar.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("sched,given,expect", [("interleaved1f1b", [], 2), ("zbvzerobubble", [], 2),
                                                ("loopedbfs", ["--virtual-stages", "3"], 3), ("1f1b", [], 1)])
def test_multi_stage_schedules_default_to_two_virtual_stages(sched, given, expect):
    """A fresh user's trial: --pp-schedule interleaved1f1b without --virtual-stages was refused
    ("needs virtual_stages >= 2"); unset, it is now the least such a schedule runs, 2."""
    from modelpar.cli.train import parse_train_config
    from modelpar.train.resolve import resolve

    cfg, _, _ = parse_train_config(["--model", "gpt-1m", "--strategy", "pp", "--nproc", "2", "--pp-schedule", sched,
                                    *given])
    assert resolve(cfg, 2).plan.virtual_stages == expect


@pytest.mark.parametrize("cmd", ["train", "plan", "verify"])
def test_a_classifier_with_fewer_logits_than_its_classes_is_refused_before_launch(tmp_path, capsys, cmd):
    """Before: a factory declaring num_classes 7 whose output has 4 logits (or verify's --num-classes 12 on
    a 10-logit MLP) launched the ranks, which each printed a traceback ending "IndexError: Target 4 is out
    of bounds"; plan ranked plans for it. Wider logits stay accepted (a padded vocabulary or head)."""
    from modelpar.cli import main

    (tmp_path / "cls.py").write_text(
        "import torch, torch.nn as nn\n"
        "def conv7():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': nn.Sequential(nn.Conv2d(1, 4, 6), nn.Flatten()), 'task': 'classify',\n"
        "            'input_shape': [1, 6, 6], 'num_classes': 7}\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))\n")
    f = str(tmp_path / "cls.py")
    if cmd == "verify":
        argv, got = ["verify", "--model", f + ":mlp", "--num-classes", "12", "--nproc", "2", "--steps", "2",
                     "--strategy", "ddp"], "(1, 10) for inputs of shape (1, 8): a classifier returns logits (batch, classes=12)"
    else:
        argv, got = [cmd, "--model", f + ":conv7", "--nproc", "2"], \
            "(1, 4) for inputs of shape (1, 1, 6, 6): a classifier returns logits (batch, classes=7)"
        argv += ["--steps", "2", "--out-dir", str(tmp_path / "runs")] if cmd == "train" else ["--hardware", "A100-80GB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert got in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
    # more logits than classes: accepted by the check
    import torch
    from modelpar.models.factory_check import check_forward

    check_forward("m:f", torch.nn.Linear(8, 10), torch.zeros(1, 8), form="classify", classes=7)


@pytest.mark.parametrize("cmd", ["train", "plan", "estimate"])
def test_a_factory_that_raises_is_one_line_naming_where(tmp_path, capsys, cmd):
    """Before: ~20 lines of modelpar's own stack ending in the factory's RuntimeError."""
    from modelpar.cli import main

    (tmp_path / "r.py").write_text("def raises():\n    raise RuntimeError('boom\\nfrom factory')\n")
    argv = [cmd, "--model", f"{tmp_path / 'r.py'}:raises", "--nproc", "2"]
    argv += ["--out-dir", str(tmp_path / "runs")] if cmd == "train" else ["--hardware", "A100-80GB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"the factory raised RuntimeError: boom from factory ({tmp_path / 'r.py'}, line 2, in raises)"
            in err), err


@pytest.mark.parametrize("model,flags,message", [
    ("lm.py:ok", ["--dropout", "0.1"], "is a factory model, whose dropout is its own: set it in the factory"),
    ("lm.py:small", [], "has vocab_size=100; raise it in its factory (its model and the vocab_size it declares)"),
])
def test_options_a_model_does_not_take_are_refused(tmp_path, capsys, model, flags, message):
    """A fresh user's trial: --dropout on a factory model was taken silently (and ignored); a factory LM with
    a small vocabulary was told to raise it in --model-config, which factories refuse."""
    from modelpar.cli import main

    (tmp_path / "lm.py").write_text(
        "import torch, torch.nn as nn\n"
        "class LM(nn.Module):\n"
        "    def __init__(self, v):\n"
        "        super().__init__(); self.e = nn.Embedding(v, 16); self.h = nn.Linear(16, v)\n"
        "    def forward(self, x): return self.h(self.e(x))\n"
        "def small():\n"
        "    torch.manual_seed(0); return {'model': LM(100), 'task': 'lm', 'vocab_size': 100, 'max_positions': 32}\n"
        "def ok():\n"
        "    torch.manual_seed(0); return {'model': LM(256), 'task': 'lm', 'vocab_size': 256, 'max_positions': 32}\n"
        "def cls():\n"
        "    torch.manual_seed(0); return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n")
    m = str(tmp_path / model) if model.endswith((":cls", ":ok", ":small")) else model
    assert main(["train", "--model", m, "--nproc", "2", "--steps", "2", "--out-dir", str(tmp_path / "runs"),
                 *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_a_classifier_whose_first_layer_is_no_linear_is_told_to_declare_its_shape():
    """A fresh user's trial: a bare CNN with a Linear head got "fails on a batch of (1, 16)" (the shape read
    from the head) without the way out the no-Linear case gives."""
    import torch

    from modelpar.models.factory_check import check_forward

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    with pytest.raises(ValueError, match=r"fails on a batch of \(1, 4\) float32 \(RuntimeError: .*\): unless declared, "
                                         r"a classifier's input shape is read from its first nn.Linear, but its first "
                                         r"layer 0 is a Conv2d; declare the shape"):
        check_forward("m:f", net, torch.zeros(1, 4), form="classify")


def test_a_pipeline_of_a_model_returning_a_dict_says_what_to_return(tmp_path, capsys):
    """A fresh user's trial: "the pipeline stages chained give dict, the whole forward dict" did not say
    what is wrong."""
    from modelpar.cli import main

    (tmp_path / "d.py").write_text(
        "import torch, torch.nn as nn\n"
        "class DictOut(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])\n"
        "    def forward(self, x): return {'logits': self.net(x)}\n"
        "def dictout():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': DictOut(), 'batch_fn': lambda s: (torch.randn(8, 8), torch.randint(0, 8, (8,))),\n"
        "            'loss_fn': lambda out, y: nn.functional.cross_entropy(out['logits'], y)}\n")
    assert main(["verify", "--model", f"{tmp_path / 'd.py'}:dictout", "--strategy", "pp", "--nproc", "2",
                 "--global-batch-size", "8", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "DictOut: its forward returns dict, not a tensor: a pipeline's last stage hands the loss one " \
           "tensor; wrap the model so its forward returns the logits" in err, err


def test_verify_refuses_a_batch_fn_whose_batch_is_not_the_global_batch(tmp_path, capsys):
    """A fresh user's trial: a batch_fn of 7 samples under the default global batch 16 ran, the layout
    dropped a sample the reference kept, and verify printed "batch 16" and FAIL without a reason."""
    from modelpar.cli import main

    (tmp_path / "b7.py").write_text(
        "import torch, torch.nn as nn\n"
        "def b7():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),\n"
        "            'batch_fn': lambda s: (torch.randn(7, 4), torch.randint(0, 3, (7,))),\n"
        "            'loss_fn': nn.functional.cross_entropy}\n")
    assert main(["verify", "--model", f"{tmp_path / 'b7.py'}:b7", "--strategy", "ddp", "--nproc", "2",
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "batch_fn(0) returned 7 samples, but the global batch is 16: batch_fn(step) returns the whole global " \
           "batch of a step; give --global-batch-size 7" in err, err


def test_language_model_options_on_a_classifier_get_a_note():
    """A fresh user's trial: --data / --seq-len on a classifier were ignored without a word. A note, not an
    error: a config file may set them for every model of a sweep (the suite's own fixtures do)."""
    from modelpar.train.task import unused_lm_options_note

    note = unused_lm_options_note(TrainConfig(model="mlp-large", data=".", seq_len=64), "classify")
    assert note == ("--data and --seq-len apply to language models (text, tokens per sample); --model mlp-large is "
                    "a classifier, trained on synthetic inputs of its own shape: not used")
    assert unused_lm_options_note(TrainConfig(model="gpt-nano", seq_len=64), "lm") == ""
    assert unused_lm_options_note(TrainConfig(model="mlp-large"), "classify") == ""


def test_a_language_model_indexed_past_an_embedding_is_told_about_positions():
    """A fresh user's trial: a factory declaring max_positions 128 around a GPT-2 of 64 positions got only
    "IndexError: index out of range in self"."""
    import torch

    from modelpar.models.factory_check import check_forward

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(256, 8), nn.Embedding(64, 8), nn.Linear(8, 256)

        def forward(self, ids):
            return self.head(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))

    with pytest.raises(ValueError, match=r"\(IndexError: index out of range in self\): one of its embeddings is "
                                         r"shorter than the ids it got, likely a position table shorter than the "
                                         r"sequence 128 \(declare the model's own max_positions"):
        check_forward("m:f", LM(), torch.zeros(1, 128, dtype=torch.long), form="lm", vocab=256)
    check_forward("m:f", LM(), torch.zeros(1, 64, dtype=torch.long), form="lm", vocab=256)


def test_a_run_shorter_than_its_warm_up_gets_a_note():
    from modelpar.cli.train import warmup_note

    assert warmup_note(TrainConfig(steps=20)) == (
        "--warmup-steps 40 > --steps 20: the learning rate rises linearly the whole run and never reaches --lr "
        "0.005; give fewer warm-up steps for the full schedule")
    assert warmup_note(TrainConfig(steps=40)) == "" and warmup_note(TrainConfig(steps=20, warmup_steps=0)) == ""
