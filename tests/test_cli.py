"""The command line as a whole: one spelling, shared options with the same defaults, every flag a
message names exists, plan files round-trip, and the planner stays pure (tier 1: no processes
except the fresh interpreter of the purity check)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelpar.cli import COMMANDS, parser_for
from modelpar.cli.args import normalize_argv, option_strings
from modelpar.cli.options import SHARED, shared_defaults

# plan / estimate profile each model once per process (tests/conftest.py `shared_profile_for`)
pytestmark = pytest.mark.usefixtures("shared_profile_for")

ROOT = Path(__file__).resolve().parent.parent
# flags of other tools that modelpar's messages and docstrings quote (torchrun, srun)
EXTERNAL_FLAGS = {"--nproc-per-node", "--max-restarts", "--standalone", "--rdzv-id", "--rdzv-endpoint",
                  "--rdzv-backend", "--ntasks-per-node", "--nodes", "--node-rank"}


def _all_flags() -> set[str]:
    return set().union(*(option_strings(parser_for(c)) for c in COMMANDS))


def test_every_flag_a_message_names_exists():
    """Collect ``--flag`` spellings from modelpar's source strings; each must be a flag of some command."""
    flags = _all_flags()
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "modelpar").rglob("*.py"):
        for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", path.read_text()):
            seen.setdefault(m.group(0), []).append(path.relative_to(ROOT).as_posix())
    # args.py documents the spelling rules themselves with examples
    missing = {f: sorted(set(p)) for f, p in seen.items()
               if f not in flags and f not in EXTERNAL_FLAGS and set(p) != {"modelpar/cli/args.py"}}
    assert not missing, f"messages name flags no command has: {missing}"
    assert "--cpu_offload" not in seen
    for c in ("train", "verify"):                 # where the cut of a model is named (issue 12)
        assert {"--blocks", "--split-points"} <= option_strings(parser_for(c)), c


def test_one_spelling_dashes():
    for c in COMMANDS:
        under = sorted(f for f in option_strings(parser_for(c)) if "_" in f)
        assert not under, (c, under)


# issue 13 item 1: the shared options every command takes (topology: where the world spans nodes)
SHARED_FLAGS = ("model", "model_config", "nproc", "nnodes", "gpus_per_node", "global_batch_size", "seq_len",
                "hardware", "plan", "strategy")
TAKES = {"train": SHARED_FLAGS, "plan": SHARED_FLAGS, "estimate": SHARED_FLAGS, "verify": SHARED_FLAGS,
         "bench": ("model", "model_config", "nproc", "global_batch_size", "seq_len", "hardware"),
         "calibrate": ("nproc",), "export": ()}
# (command, field) -> why its default or help differs from the shared group's
OWN_DEFAULT = {("bench", "global_batch_size"): "0 = its per-model rows (docs/bench.md)",
               ("bench", "model"): "empty = its --models list"}
OWN_HELP = {**OWN_DEFAULT, ("calibrate", "nproc"): "ranks that will share the machine in training"}


def test_shared_options_same_names_defaults_and_help_everywhere():
    """Every command's parser has its shared options, each with the shared group's default and help
    text (`modelpar.cli.options`), apart from the few listed above with their reason; `TrainConfig`
    holds the same defaults."""
    from modelpar.cli.options import shared_docs
    from modelpar.train.config import TrainConfig

    assert set(TAKES) == set(COMMANDS)
    defaults, docs = shared_defaults(), shared_docs()
    assert set(SHARED_FLAGS) <= set(defaults) and all(docs[f] for f in SHARED_FLAGS)
    cfg = TrainConfig()
    for name in defaults:
        if hasattr(cfg, name):
            assert getattr(cfg, name) == defaults[name], name
    for c in COMMANDS:
        p = parser_for(c)
        by_dest = {a.dest: a for a in p._actions}
        missing = [f for f in TAKES[c] if f"--{f.replace('_', '-')}" not in option_strings(p)]
        assert not missing, (c, missing)
        for name in defaults:
            a = by_dest.get(name)
            if a is None:
                continue
            if (c, name) not in OWN_DEFAULT:
                assert a.default == defaults[name], (c, name, a.default, defaults[name])
            if (c, name) not in OWN_HELP:
                assert a.help == docs[name], (c, name, a.help)
    for (c, name) in OWN_HELP:                    # each exception is real (no stale entries)
        assert name in {a.dest for a in parser_for(c)._actions}, (c, name)


# the plan flags (one per `ParallelPlan` field, `PlanOptions`): every one in these commands; `plan` takes the
# fields that narrow its search (it ranks layouts: degrees go to --plan or `estimate`)
PLAN_FLAGS_TAKEN = {"train": "all", "verify": "all", "estimate": "all",
                    "plan": ("precision", "activation_checkpointing", "ac_every")}


def test_plan_flags_same_names_defaults_help_and_dest_as_train():
    """Every command that takes a `ParallelPlan` field's flag takes it as `train` does: the same flag,
    default (None: unset), help text and destination (``layout.<field>``, what the one resolution,
    `modelpar.train.resolve`, reads); no command has a second spelling of a plan field."""
    from modelpar.plan import ParallelPlan

    fields = [f.name for f in dataclasses.fields(ParallelPlan)]
    train = {a.dest: a for a in parser_for("train")._actions if a.dest.startswith("layout.")}
    assert set(train) == {f"layout.{f}" for f in fields}
    for c in COMMANDS:
        p = parser_for(c)
        by_flag = {s: a for a in p._actions for s in a.option_strings}
        want = fields if PLAN_FLAGS_TAKEN.get(c) == "all" else PLAN_FLAGS_TAKEN.get(c, ())
        for f in fields:
            a = by_flag.get(f"--{f.replace('_', '-')}")
            if f not in want:
                assert a is None or not a.dest.endswith(f), (c, f, "takes a plan field train's way or not at all")
                continue
            assert a is not None, (c, f)
            t = train[f"layout.{f}"]
            assert (a.dest, a.default, a.help, type(a)) == (t.dest, t.default, t.help, type(t)), (c, f)
        # no plan field under another name (estimate had its own LayoutDegrees and plan_options.*)
        assert not [a.dest for a in p._actions if a.dest.startswith("plan_options.")], c


def test_booleans_bare_and_negated_and_old_spellings(capsys):
    from modelpar.cli.train import parse_train_config

    cfg, _, _ = parse_train_config(["--compile", "--no-track-memory"])
    assert cfg.layout.compile and not cfg.track_memory
    assert parse_train_config(["--no-compile"])[0].layout.compile is False
    assert parse_train_config([])[0].layout.compile is None           # not given: the strategy's / plan's
    cfg, _, given = parse_train_config(["--global_batch_size", "8", "--track_memory", "false", "--cpu_offload=true"])
    assert (cfg.global_batch_size, cfg.track_memory, cfg.layout.cpu_offload) == (8, False, True)
    err = capsys.readouterr().err
    assert "deprecated" in err and "--global_batch_size -> --global-batch-size" in err
    # degrees without a strategy run exactly them
    cfg, _, _ = parse_train_config(["--dp-shard", "2", "--tp", "2", "--sequence-parallel"])
    assert cfg.strategy == "custom" and cfg.layout.sequence_parallel is True and cfg.layout.tp == 2
    p = parser_for("verify")
    assert normalize_argv(["--global_batch_size", "8"], p, prog="x") == ["--global_batch_size", "8"]  # train only


def test_every_plan_field_has_a_train_flag():
    from modelpar.plan import ParallelPlan

    flags = option_strings(parser_for("train"))
    for f in dataclasses.fields(ParallelPlan):
        assert f"--{f.name.replace('_', '-')}" in flags, f.name


def test_plan_file_round_trip_and_errors(tmp_path):
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile, read_plan_file

    pf = PlanFile(ParallelPlan(dp_shard=2, pp=2, n_microbatches=4, sequence_parallel=False), 64, 8, "test")
    path = pf.write(tmp_path / "plan.json")
    back = read_plan_file(path)
    assert back == pf and back.micro_batch_size == 2 and back.accum_steps == 4
    assert read_plan_file('{"tp": 2}').plan.tp == 2
    with pytest.raises(ValueError, match=r"unknown keys \['tp_degree'\]"):
        read_plan_file('{"tp_degree": 2}')
    d = json.loads(path.read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**d, "world_size": 8}))
    with pytest.raises(ValueError, match="world_size=8 disagrees"):
        read_plan_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no such file"):
        read_plan_file(tmp_path / "none.json")


def test_train_plan_file_resolves_and_contradictions_refused(tmp_path):
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile
    from modelpar.train.config import TrainConfig
    from modelpar.train.resolve import resolve

    f = PlanFile(ParallelPlan(dp_shard=2), 8, 2).write(tmp_path / "plan.json")
    r = resolve(TrainConfig(model="gpt-nano", plan=str(f), global_batch_size=8), 2)
    assert r.plan.dp_shard == 2 and r.local_batch_size == 2
    with pytest.raises(ValueError, match="give --plan or --strategy, not both"):
        resolve(TrainConfig(model="gpt-nano", plan=str(f), strategy="ddp", global_batch_size=8), 2)
    with pytest.raises(ValueError, match="--precision 'bf16' contradicts --plan"):
        resolve(TrainConfig(model="gpt-nano", plan=str(f), precision="bf16", global_batch_size=8), 2)
    with pytest.raises(ValueError, match="pass --global-batch-size 8"):
        resolve(TrainConfig(model="gpt-nano", plan=str(f), global_batch_size=16), 2)


def test_estimate_exact_layout_json(capsys):
    from modelpar.cli.estimate import main
    from modelpar.plan_file import parse_plan_file

    assert main(["--model", "gpt-1m", "--nproc", "2", "--strategy", "fsdp", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pf = parse_plan_file(d)                       # the estimate is a plan file
    assert pf.plan.dp_shard == 2 and pf.local_batch_size == 2 and pf.accum_steps == 2
    pr = d["predicted"]
    assert pr["step_s"] > 0 and 0 < pr["mfu"] <= pr["hfu"] < 1 and pr["fits"] is True
    assert set(pr["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert main(["--model", "gpt-1m", "--nproc", "2", "--tp", "2", "--micro-batch-size", "2",
                 "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "tp2 on 2 x cpu" in out and "MFU" in out and "HFU" in out and "tokens/s per device" in out
    assert "precision:" not in out                # fp32: no mechanism to name
    # bf16: which mechanism the layout runs (and the planner prices): autocast, or FSDP2's policy
    for flags, says in ((["--pp", "2", "--n-microbatches", "2"], "under torch.autocast over fp32 parameters"),
                        (["--pp", "2", "--n-microbatches", "2", "--dp-replicate", "2", "--nproc", "4"],
                         "bf16 parameters by FSDP2's mixed-precision policy (replicate)")):
        assert main(["--model", "gpt-1m", "--nproc", "2", "--precision", "bf16", "--micro-batch-size", "2",
                     "--global-batch-size", "8", *flags]) == 0
        assert says in capsys.readouterr().out
    with pytest.raises(ValueError, match="--strategy fsdp on 2 ranks sets tp=1"):
        main(["--model", "gpt-1m", "--nproc", "2", "--strategy", "fsdp", "--tp", "2"])


def test_hf_and_factory_models_named_clearly():
    from modelpar.models.spec import check_model

    with pytest.raises(ValueError, match="has no model type 'lamma'"):
        check_model("hf:lamma")
    with pytest.raises(ValueError, match="runs built-in models only"):
        check_model("mypkg:make", allow_factory=False)
    with pytest.raises(ValueError, match=r"unknown GPT fields \['layers'\]"):
        check_model("gpt-nano", {"layers": 3})
    assert check_model("gpt-nano", {"n_layer": 3}) == "builtin"


@pytest.mark.slow
def test_planner_imports_no_runtime_cli_or_launcher():
    """`modelpar.planner` in a fresh interpreter loads no training runtime, CLI, launcher, calibration
    or process-starting module beyond what ``import torch`` itself loads (torch imports subprocess and
    torch.multiprocessing on its own)."""
    code = ("import sys, torch; base = set(sys.modules); import modelpar.planner; "
            "new = set(sys.modules) - base; "
            "bad = [m for m in new if m.startswith(('modelpar.train', 'modelpar.cli', 'modelpar.launch', "
            "'modelpar.calibrate', 'modelpar.measure', 'modelpar.bench', 'modelpar.verify', 'torch.distributed.run', "
            "'torch.distributed.elastic', 'torch.distributed.launch')) or m in ('subprocess', 'multiprocessing')]; "
            "print(sorted(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_train_many_nodes_resolves_once_and_prints_the_launch_line(tmp_path, capsys):
    from modelpar.cli.train import main, read_run_folder

    assert main(["--model", "gpt-nano", "--nnodes", "2", "--gpus-per-node", "1", "--strategy", "ddp",
                 "--global-batch-size", "4", "--seq-len", "16", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (run,) = list(tmp_path.iterdir())
    assert "torchrun --nnodes 2 --nproc-per-node 1" in out and f"--run-dir {run}" in out and "srun" in out
    cfg, resolved = read_run_folder(run)            # what every rank reads: no re-planning
    assert cfg.model == "gpt-nano" and resolved.plan.dp_replicate == 2 and resolved.local_batch_size == 2
    (run / "plan.json").write_text('{"dp_replicate": 2, "world_size": 3}')
    with pytest.raises(ValueError, match="world_size=3 disagrees"):
        read_run_folder(run)


def test_train_auto_prints_the_planner_predicted_tokens_per_s(tmp_path, capsys):
    """`train --strategy auto` says what throughput to expect (the planner's prediction for the chosen
    plan) before any rank starts; two significant digits; "this machine" without --hardware."""
    from modelpar.cli.train import expected_rate_line, main
    from modelpar.train.config import TrainConfig

    assert expected_rate_line(TrainConfig(), 5353.2) == "expected ~5,400 tokens/s on this machine (planner prediction)"
    assert expected_rate_line(TrainConfig(hardware="H200"), 87.4) == "expected ~87 tokens/s on H200 (planner prediction)"
    assert main(["--model", "gpt-nano", "--nnodes", "2", "--gpus-per-node", "1", "--hardware", "A100-80GB",
                 "--global-batch-size", "4", "--seq-len", "16", "--out-dir", str(tmp_path)]) == 0
    m = re.search(r"^expected ~([\d,]+) tokens/s on A100-80GB \(planner prediction\)$", capsys.readouterr().out,
                  re.MULTILINE)
    assert m and int(m.group(1).replace(",", "")) > 0


@pytest.mark.parametrize("strategy, measures", [("auto", True), ("rules", False), ("ddp", False)])
def test_only_train_strategy_auto_calibrates_by_itself(monkeypatch, strategy, measures):
    """Issue 13 item 1: `train --strategy auto` may measure an uncalibrated machine; `rules` and the
    named strategies use the uncalibrated estimate (as plan / estimate / bench do)."""
    import modelpar.train.resolve as resolve_mod
    from modelpar.cli.train import main

    seen = []

    def fake_resolve(cfg, world, *, measure_if_missing=False):
        seen.append(measure_if_missing)
        raise ValueError("stop here")

    monkeypatch.setattr(resolve_mod, "resolve", fake_resolve)
    with pytest.raises(ValueError, match="stop here"):
        main(["--model", "gpt-nano", "--strategy", strategy, "--nproc", "2", "--global-batch-size", "4"])
    assert seen == [measures]


def test_bench_takes_the_shared_model_flag():
    """`modelpar bench --model M` is `--models M` (the shared spelling); both at once are refused; an
    unknown name fails before any row runs."""
    from modelpar.cli.bench import main

    with pytest.raises(ValueError, match="give --model or --models, not both"):
        main(["--model", "gpt-nano", "--models", "gpt-1m"])
    with pytest.raises(ValueError, match="no-such-model"):
        main(["--model", "no-such-model"])


def test_config_holds_one_layout_and_old_run_folders_still_load(tmp_path, capsys):
    """Issue 13 item 3: `TrainConfig` holds the strategy / plan file and one `layout` (`PlanOptions`,
    made from `ParallelPlan`: no plan field mirrored by hand); a run folder written before it (flat
    fields, ``tp: 0``, ``plan_options``) and an old flat ``--config`` file still load."""
    import yaml

    from modelpar.cli.train import parse_train_config, read_run_folder, write_run_folder
    from modelpar.plan import ParallelPlan
    from modelpar.train.config import PLAN_FIELDS, PlanOptions, TrainConfig
    from modelpar.train.resolve import given_fields

    assert [f.name for f in dataclasses.fields(PlanOptions)] == [f.name for f in dataclasses.fields(ParallelPlan)]
    assert not {f.name for f in dataclasses.fields(TrainConfig)} & set(PLAN_FIELDS)
    cfg, resolved = read_run_folder(ROOT / "tests" / "data" / "legacy_run")
    assert (cfg.model, cfg.steps, cfg.strategy) == ("gpt-nano", 20, "auto")
    assert given_fields(cfg) == {}                 # every old field held its 'unset' value
    assert resolved.plan == ParallelPlan(dp_replicate=2) and resolved.local_batch_size == 8
    old = yaml.safe_load((ROOT / "tests" / "data" / "legacy_run" / "config.yaml").read_text())
    old.update(tp=2, dp_shard=2, pp_schedule="gpipe", stage_boundaries=[], plan_options={"sequence_parallel": True})
    flat = TrainConfig.from_dict(old)
    assert given_fields(flat) == {"tp": 2, "dp_shard": 2, "pp_schedule": "gpipe", "sequence_parallel": True}
    run = tmp_path / "run"                        # the current form round-trips through a run folder
    write_run_folder(flat, resolved, type("B", (), {"global_batch_size": 16, "local_batch_size": 8}), run)
    assert "layout:" in (run / "config.yaml").read_text()
    assert read_run_folder(run)[0] == flat
    with pytest.raises(ValueError, match=r"unknown TrainConfig fields \['tp_degree'\]"):
        TrainConfig.from_dict({**old, "tp_degree": 2})
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({"steps": 5, "tp": 2, "dp_shard": 2}))
    cfg, _, _ = parse_train_config(["--config", str(tmp_path / "old.yaml"), "--pp-schedule", "gpipe"])
    assert cfg.steps == 5 and given_fields(cfg) == {"tp": 2, "dp_shard": 2, "pp_schedule": "gpipe"}
    assert "put them under 'layout:'" in capsys.readouterr().err
    (tmp_path / "new.yaml").write_text((run / "config.yaml").read_text())
    assert parse_train_config(["--config", str(tmp_path / "new.yaml")])[0] == flat


def test_hf_default_seq_len_is_one_number_in_every_command(capsys):
    """``--seq-len 0`` on a Hugging Face language model whose positions exceed the default resolves to
    the same sequence in plan, estimate, train and verify (before: 2048, 2048, 1024 and 64), so `plan`
    prices what `train` runs; bench trains through train's config."""
    pytest.importorskip("transformers")
    from helpers.hf_tiny import TINY

    from modelpar.cli.estimate import main as estimate_main
    from modelpar.cli.plan import main as plan_main
    from modelpar.cli.train import parse_train_config
    from modelpar.cli.verify import build_parser, load_task
    from modelpar.cli.args import parse
    from modelpar.train.task import lm_shape

    spec, over = TINY["llama"]
    argv = ["--model", spec, "--model-config", json.dumps({**over, "max_position_embeddings": 4096}),
            "--nproc", "2", "--global-batch-size", "2", "--hardware", "cpu"]
    seen = {}
    assert plan_main(argv + ["--top", "1"]) == 0
    seen["plan"] = int(re.search(r"seq (\d+)", capsys.readouterr().out).group(1))
    assert estimate_main(argv) == 0
    seen["estimate"] = int(re.search(r"seq (\d+)", capsys.readouterr().out).group(1))
    seen["train"] = lm_shape(parse_train_config(argv)[0]).seq_len
    seen["verify"] = load_task(parse(build_parser(), argv))[1](0)[0].shape[1]
    assert len(set(seen.values())) == 1, seen
    from modelpar.cli.options import shared_docs
    from modelpar.models.hf import DEFAULT_SEQ_LEN

    assert seen["train"] == DEFAULT_SEQ_LEN == 1024
    assert f"min(its max_position_embeddings, {DEFAULT_SEQ_LEN})" in shared_docs()["seq_len"]


_BASE = ["--model", "gpt-nano", "--global-batch-size", "8", "--hardware", "cpu"]


def _train_resolution(argv):
    """What `modelpar train` resolves for ``argv`` (its parser, world size and `resolve`), or the error."""
    from modelpar.cli.options import run_world_size
    from modelpar.cli.train import parse_train_config
    from modelpar.train.resolve import resolve

    try:
        cfg, ns, given = parse_train_config(argv)
        return resolve(cfg, run_world_size(ns, given, cfg.strategy)).plan
    except ValueError as e:
        return str(e)


def _estimate_resolution(argv, capsys):
    from modelpar.cli.estimate import main
    from modelpar.plan_file import parse_plan_file

    try:
        main(argv + ["--json"])
    except ValueError as e:
        return str(e)
    return parse_plan_file(json.loads(capsys.readouterr().out)).plan


@pytest.mark.parametrize("flags", [
    ["--strategy", "pp", "--nproc", "2"],
    ["--dp-shard", "2", "--compile", "--no-reshard-after-forward", "--nproc", "2"],
    ["--strategy", "fsdp+tp", "--tp", "2", "--nproc", "4", "--sequence-parallel"],
    ["--strategy", "fsdp", "--tp", "2", "--nproc", "2"],             # errors: the same message
    ["--strategy", "auto", "--tp", "2", "--nproc", "2"],
    ["--strategy", "custom", "--nproc", "2"],
    ["--plan", "PLAN", "--tp", "2"],
    ["--plan", "PLAN", "--activation-checkpointing", "full"],
    ["--plan", "PLAN", "--n-microbatches", "4"],
])
def test_estimate_resolves_the_plan_flags_as_train(flags, tmp_path, capsys):
    """`estimate` turns --strategy / degrees / --plan / the plan flags into the plan `train` would run
    (the same `modelpar.train.resolve.resolve`), or refuses them with train's message."""
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile

    f = PlanFile(ParallelPlan(dp_shard=2, pp=2, n_microbatches=4), 8, 4).write(tmp_path / "plan.json")
    argv = _BASE + [str(f) if a == "PLAN" else a for a in flags]
    want = _train_resolution(argv)
    assert _estimate_resolution(argv, capsys) == want
    assert want != ParallelPlan()                 # each case resolves to a layout or an error


@pytest.mark.parametrize("flags", [["--strategy", "fsdp", "--nproc", "2"], ["--strategy", "pp", "--nproc", "2"],
                                   ["--strategy", "ddp", "--nproc", "4"], ["--plan", "PLAN"]])
def test_estimate_prices_the_batch_train_runs(flags, tmp_path, capsys):
    """Without --micro-batch-size `estimate` prices the local batch and accumulation `train` runs with
    the same flags (`train.loop.batch_terms`: global / dp, or the plan file's local batch); it
    priced one sample per micro-batch before (gpt-nano fsdp on 2: local 1 and accumulation 4 where
    train runs local 4 and accumulation 1)."""
    from modelpar.cli.estimate import main
    from modelpar.cli.options import run_world_size
    from modelpar.cli.train import parse_train_config
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile
    from modelpar.train.loop import batch_terms
    from modelpar.train.resolve import resolve

    f = PlanFile(ParallelPlan(dp_shard=2, pp=2, n_microbatches=4), 8, 4).write(tmp_path / "plan.json")
    argv = _BASE + [str(f) if a == "PLAN" else a for a in flags]
    cfg, ns, given = parse_train_config(argv)
    r = resolve(cfg, run_world_size(ns, given, cfg.strategy))
    want = batch_terms(cfg, r.plan, r.local_batch_size)
    main(argv + ["--json"])
    got = json.loads(capsys.readouterr().out)
    assert (got["global_batch_size"], got["local_batch_size"]) == (want.global_batch_size, want.local_batch_size)


@pytest.mark.parametrize("mode", ["every-k", "none"])
def test_checkpointing_flags_narrow_train_auto_and_plan_alike(mode, capsys):
    """--activation-checkpointing / --ac-every mean the same in `train --strategy auto`'s search and in
    `plan`'s (`modelpar.train.resolve.search_settings`): the mode given, and the search's k (2, 4) when
    --ac-every is not (train searched only k = 1 before; `none` let train's planner pick any mode)."""
    from modelpar.cli.plan import main as plan_main
    from modelpar.cli.train import parse_train_config
    from modelpar.plan_file import parse_plan_file
    from modelpar.train.resolve import resolve

    argv = _BASE + ["--model", "gpt-1m", "--nproc", "2", "--activation-checkpointing", mode]   # 4 blocks
    chosen = resolve(parse_train_config(argv)[0], 2).plan
    assert plan_main(argv + ["--explain", "1", "--json"]) == 0
    ranked = parse_plan_file(json.loads(capsys.readouterr().out)).plan
    got = [(p.activation_checkpointing, p.ac_every) for p in (chosen, ranked)]
    assert got[0] == got[1] and got[0][0] == mode and (mode != "every-k" or got[0][1] in (2, 4)), got


def test_a_plan_file_brings_its_global_batch_in_every_command(tmp_path, monkeypatch, capsys):
    """``--plan FILE`` without --global-batch-size: train, verify, estimate and plan all take the file's
    global batch (train and verify refused it before: "pass --global-batch-size 8"); a given value
    that differs is still refused."""
    import modelpar.launch
    from modelpar.cli.estimate import main as estimate_main
    from modelpar.cli.plan import main as plan_main
    from modelpar.cli.train import parse_train_config
    from modelpar.cli.verify import main as verify_main
    from modelpar.plan import ParallelPlan
    from modelpar.plan_file import PlanFile, read_plan_file
    from modelpar.train.resolve import resolve

    f = PlanFile(ParallelPlan(dp_shard=2), 8, 2).write(tmp_path / "plan.json")
    argv = ["--model", "gpt-nano", "--plan", str(f), "--hardware", "cpu"]
    got = {}
    cfg = parse_train_config(argv)[0]
    got["train"] = (cfg.global_batch_size, resolve(cfg, 2).local_batch_size)
    for name, main in (("estimate", estimate_main), ("plan", plan_main)):
        assert main(argv + ["--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        got[name] = (d["global_batch_size"], d["local_batch_size"])

    class Launched:                               # verify's launch, stopped: what its ranks would read
        def __init__(self, target, world, **kw):
            import shutil

            run_dir = Path(target[target.index("--run-dir") + 1])
            pf = read_plan_file(run_dir / "plan.json")
            got["verify"] = (pf.global_batch_size, pf.local_batch_size)
            shutil.rmtree(run_dir)

        def report(self, prog):
            return 0, ""
    monkeypatch.setattr(modelpar.launch, "run_command", Launched)
    assert verify_main(argv + ["--steps", "1"]) == 0
    assert got == dict.fromkeys(("train", "estimate", "plan", "verify"), (8, 2)), got
    with pytest.raises(ValueError, match="pass --global-batch-size 8"):
        resolve(parse_train_config(argv + ["--global-batch-size", "16"])[0], 2)


def test_strategy_rules_keeps_the_checkpointing_given(capsys):
    """The rules baseline chooses no checkpointing; `train --strategy rules --activation-checkpointing
    full` dropped the flag silently before; now train and plan both apply it on top of the rules plan."""
    from modelpar.cli.plan import main as plan_main
    from modelpar.cli.train import parse_train_config
    from modelpar.plan_file import parse_plan_file
    from modelpar.train.resolve import resolve

    argv = _BASE + ["--model", "gpt-1m", "--nproc", "2", "--strategy", "rules", "--activation-checkpointing", "full"]
    chosen = resolve(parse_train_config(argv)[0], 2).plan
    assert plan_main(argv + ["--explain", "1", "--json"]) == 0
    priced = parse_plan_file(json.loads(capsys.readouterr().out)).plan
    assert chosen == priced and chosen.activation_checkpointing == "full", (chosen, priced)


def test_factory_lm_default_seq_len_is_its_max_positions_in_train_and_verify():
    """``--seq-len 0`` on a factory language model is its max_positions in train (and the planner
    commands, `modelpar.cli.common.factory_lm_seq_len`) and now in verify too (it capped it at 64)."""
    from modelpar.cli.args import parse
    from modelpar.cli.common import factory_lm_seq_len
    from modelpar.cli.train import parse_train_config
    from modelpar.cli.verify import build_parser, load_task
    from modelpar.train.task import lm_shape

    argv = ["--model", "helpers.lm_factory:lm_long", "--global-batch-size", "2", "--strategy", "ddp"]
    seen = {"train": lm_shape(parse_train_config(argv)[0]).seq_len,
            "verify": load_task(parse(build_parser(), argv))[1](0)[0].shape[1],
            "plan": factory_lm_seq_len("helpers.lm_factory:lm_long", {"max_positions": 96}, 0)}
    assert seen == dict.fromkeys(seen, 96), seen


def test_train_unset_precision_follows_the_planner_rule(monkeypatch):
    """An unset --precision: train runs bf16 where plan / estimate price bf16 (a bf16-capable CUDA
    GPU), fp32 on the CPU; a given one or a plan file's is kept (`train.resolve.with_run_precision`)."""
    import torch

    from modelpar.cli.train import parse_train_config
    from modelpar.train.resolve import with_run_precision

    cfg, _, _ = parse_train_config(["--model", "gpt-nano"])
    assert cfg.layout.precision is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert with_run_precision(cfg).layout.precision == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert with_run_precision(cfg).layout.precision == "bf16"
    given, _, _ = parse_train_config(["--model", "gpt-nano", "--precision", "fp32"])
    assert with_run_precision(given).layout.precision == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert with_run_precision(cfg).layout.precision == "fp32"


def test_optimizer_flag_one_meaning_in_every_command():
    """--optimizer: the same default and help wherever it is taken (train, verify, plan, estimate), and
    every name the planner prices trains (`train.step.make_optimizer`)."""
    import torch

    from modelpar.planner.memory import OPTIMIZER_BYTES
    from modelpar.train.step import OPTIMIZERS, make_optimizer

    seen = {}
    for c in COMMANDS:
        a = {s: a for a in parser_for(c)._actions for s in a.option_strings}.get("--optimizer")
        if a is not None:
            seen[c] = (a.default, a.help)
    assert {"train", "verify", "plan", "estimate"} <= set(seen) and len(set(seen.values())) == 1, seen
    assert set(OPTIMIZERS) == set(OPTIMIZER_BYTES)
    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = make_optimizer([w], "sgd_momentum", lr=0.1)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9


def test_train_refuses_a_pipeline_cut_the_factory_forward_cannot_keep_before_launch(tmp_path):
    """A factory model whose forward adds a residual around each block (`helpers.lm_factory.TinyLM`) is
    refused under a pipeline by `modelpar train` before any process starts and before the run folder
    (it was refused on the ranks after launch: the preflight held the model on meta, where only shapes
    compare), with the fix named; the same model with the residual inside its blocks passes."""
    from modelpar.cli.train import main as train_main, parse_train_config
    from modelpar.train.loop import preflight

    argv = ["--model", "helpers.lm_factory:lm", "--strategy", "pp", "--nproc", "2", "--steps", "1",
            "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(ValueError, match=r"the pipeline stages chained differ from the whole forward .*residual "
                                         r"inside each block's forward"):
        train_main(argv)            # (`modelpar.cli.main` prints it as one line and exits with code 2)
    assert not (tmp_path / "runs").exists()
    cfg, _, _ = parse_train_config(["--model", "helpers.lm_factory:lm_pipelined", "--strategy", "pp", "--nproc", "2"])
    plan, _ = preflight(cfg, 2)
    assert plan.pp == 2


def test_train_notes_a_sequence_past_a_gpt_presets_positions():
    """``--seq-len`` past a built-in GPT's positions is allowed (the learned table is sized to it) but
    noted before launch with what it costs (the run printed nothing for 10 minutes at 100,000)."""
    from modelpar.cli.train import long_sequence_note
    from modelpar.train.config import TrainConfig

    note = long_sequence_note(TrainConfig(model="gpt-1m", seq_len=100_000))
    assert "--seq-len 100,000 is past gpt-1m's 128 positions" in note and "12.8M parameters" in note, note
    assert long_sequence_note(TrainConfig(model="gpt-1m", seq_len=128)) == ""
    assert long_sequence_note(TrainConfig(model="gpt-1m")) == ""
    assert long_sequence_note(TrainConfig(model="gpt-1m", seq_len=512, model_config={"seq_len": 1024})) == ""
    assert long_sequence_note(TrainConfig(model="helpers.lm_factory:lm", seq_len=32)) == ""


def test_train_refuses_model_config_on_a_factory_model_before_launch(tmp_path):
    """``--model-config`` on a factory model was ignored by `modelpar train` (the factory built its own
    shape; the run folder's config.yaml still recorded the override) where plan / verify refuse it."""
    from modelpar.cli.train import main as train_main

    argv = ["--model", "helpers.lm_factory:lm", "--model-config", '{"n_layer": 2}', "--strategy", "fsdp",
            "--nproc", "2", "--steps", "1", "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(ValueError, match=r"--model-config overrides the shape of a GPT preset; "
                                         r"'helpers.lm_factory:lm' takes none"):
        train_main(argv)
    assert not (tmp_path / "runs").exists()


def test_verify_takes_degrees_without_strategy_on_a_factory_model():
    """``verify --pp 2 --dp-shard 2`` on a factory model without ``--strategy`` means custom, as the help
    and train say (it was refused as ``--strategy auto``, which planned built-in models only then)."""
    from modelpar.cli.args import given_fields, normalize_argv, parse
    from modelpar.cli.verify import build_parser, resolve_plan

    p = build_parser()
    argv = normalize_argv(["--model", "helpers.lm_factory:lm_pipelined", "--pp", "2", "--dp-shard", "2",
                           "--nproc", "4", "--global-batch-size", "8"], p, prog="modelpar verify")
    plan, _ = resolve_plan(parse(p, argv), given_fields(p, argv))
    assert (plan.pp, plan.dp_shard, plan.world_size) == (2, 2, 4)
    # --strategy auto (the default) plans a factory of train's forms as train does (it was refused: "plans
    # built-in models only", fresh-user trial); verify's own batch_fn form needs a layout
    argv = normalize_argv(["--model", "helpers.lm_factory:lm_pipelined", "--nproc", "4", "--global-batch-size", "8",
                           "--hardware", "cpu"], p, prog="modelpar verify")
    plan, _ = resolve_plan(parse(p, argv), given_fields(p, argv))
    assert plan.world_size == 4
    argv = normalize_argv(["--model", "helpers.lm_factory:with_batch_fn", "--nproc", "4"], p, prog="modelpar verify")
    with pytest.raises(ValueError, match=r"--strategy auto plans the forms train runs .* brings its own batch_fn"):
        resolve_plan(parse(p, argv), given_fields(p, argv))


def test_verify_reads_the_factory_declared_classifier_shape():
    """verify builds its batches from the shape a classifier factory declares (as train does), not from
    the first nn.Linear (fresh-user trial: a (8, 8) input with Linear(8, 8) blocks got (batch, 8))."""
    from modelpar.cli.args import parse
    from modelpar.cli.verify import build_parser, load_task

    argv = ["--model", "helpers.lm_factory:conv_classifier", "--global-batch-size", "4", "--strategy", "ddp"]
    x, y = load_task(parse(build_parser(), argv))[1](0)
    assert tuple(x.shape) == (4, 1, 6, 6) and int(y.max()) < 4
    x, _ = load_task(parse(build_parser(), argv + ["--input-shape", "36"]))[1](0)
    assert tuple(x.shape) == (4, 36)                      # a given --input-shape still wins
