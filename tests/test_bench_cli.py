"""`modelpar bench` end to end on a tiny model: tables, skip reasons, charts, resume, interruption."""

import csv
import json

import pytest

from modelpar.bench import suite
from modelpar.cli import bench as cli

ARGS = ["--models", "gpt-nano", "--warmup", "0", "--steps", "1", "--no-fit", "--timeout", "180"]


def rows(out):
    with open(out / "bench.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_bench_tables_charts_resume(tmp_path, capsys):
    out = tmp_path / "b"
    rc = cli.bench_main([*ARGS, "--strategies", "single,pp,pp-interleaved", "--out-dir", str(out)])
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out.resolve())   # the folder, last
    r = {x["row"]: x for x in rows(out)}
    assert r["single"]["status"] == "ok" and float(r["single"]["samples_per_s"]) > 0
    assert r["pp"]["status"] == "ok"
    assert r["pp-interleaved"]["status"] == "skipped"
    assert "only 2 blocks" in r["pp-interleaved"]["reason"]          # gpt-nano cannot take 4 stages
    md = (out / "bench.md").read_text()
    assert "skipped: ValueError" in md and "| single device | single | 1 |" in md
    for name in ("throughput-gpt-nano.png", "memory-gpt-nano.png", "pipeline-gpt-nano-pp.png"):
        assert 0 < (out / "img" / name).stat().st_size < 300_000
    # resume: nothing re-run, nothing duplicated
    calls = []
    orig = suite.run_row
    suite.run_row = lambda *a, **k: calls.append(a) or orig(*a, **k)
    try:
        assert cli.bench_main([*ARGS, "--strategies", "single,pp,pp-interleaved", "--out-dir", str(out), "--resume"]) == 0
    finally:
        suite.run_row = orig
    assert calls == [] and len(rows(out)) == 3


@pytest.mark.slow          # the rows are stand-ins, but the command still starts a process
def test_interrupted_bench_keeps_finished_rows(tmp_path, monkeypatch):
    out = tmp_path / "i"
    seen = []

    def fake_run_row(spec, out_dir, **kw):
        if seen:
            raise KeyboardInterrupt
        seen.append(spec.key)
        return json.loads(json.dumps({"status": "failed", "reason": "stand-in"}))
    monkeypatch.setattr(suite, "run_row", fake_run_row)
    rc = cli.bench_main([*ARGS, "--strategies", "single,ddp,fsdp", "--out-dir", str(out)])
    assert rc == 130
    assert [x["row"] for x in rows(out)] == ["single"]
    assert (out / "bench.md").exists()


def test_bad_arguments_exit_2(capsys):
    """Refused before anything runs: pure tier (the guard fails it if a process starts)."""
    assert cli.bench_main(["--strategies", "warp"]) == 2
    assert "unknown strategies ['warp']" in capsys.readouterr().err
    assert cli.bench_main(["--models", "gpt-huge"]) == 2


@pytest.mark.slow
def test_bench_runs_a_hugging_face_model(tmp_path, capsys):
    """`--models hf:<type> --model-config` (issue 12): the rows train the HF model, the planner predicts
    them, and the chart files get a file-safe name."""
    pytest.importorskip("transformers")
    from helpers import hf_tiny

    spec, cfg = hf_tiny.TINY["llama"]
    cfg = {**cfg, "vocab_size": 256}          # bench trains on bytes: ids 0..255
    out = tmp_path / "h"
    rc = cli.bench_main(["--models", spec, "--model-config", json.dumps(cfg), "--seq-len", "16", "--warmup", "0",
                         "--steps", "1", "--no-fit", "--timeout", "180", "--strategies", "single",
                         "--out-dir", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    (r,) = rows(out)
    assert r["model"] == "hf:llama" and r["status"] == "ok" and float(r["samples_per_s"]) > 0
    assert float(r["pred_samples_per_s"]) > 0 and float(r["pred_mem_mib"]) > 0
    assert (out / "img" / "throughput-hf_llama.png").stat().st_size > 0
    assert cli.bench_main(["--models", "hf:llama,gpt-nano", "--model-config", json.dumps(cfg)]) == 2
    assert "--model-config applies to one model" in capsys.readouterr().err


def test_blocks_and_split_points_reach_every_row():
    """``bench --blocks / --split-points`` (the flags its pipeline skip messages name) are parsed and
    carried into each row's training config, where `preflight` and the rank workers read them."""
    from modelpar.bench.runner import make_rows

    p = cli.build_parser()
    args = p.parse_args(["--model", "gpt-nano", "--blocks", "blocks", "--split-points", "blocks.1"])
    assert (args.blocks, args.split_points) == ("blocks", "blocks.1")
    rows = make_rows("gpt-nano", ["ddp", "pp-gpipe"], nproc=2, hybrid_nproc=4, global_batch_size=8,
                     blocks=args.blocks, split_points=args.split_points)
    assert [(r.train_config().blocks, r.train_config().split_points) for r in rows] == [("blocks", "blocks.1")] * 2
    assert make_rows("gpt-nano", ["ddp"], nproc=2, hybrid_nproc=4, global_batch_size=8)[0].train_config().blocks == ""
