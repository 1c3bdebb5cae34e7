"""Real bench rows on 2 CPU ranks (gloo): DDP's gradient all-reduce bytes read from the profiler trace,
and a pipeline's per-micro-batch timeline."""

import pytest

from modelpar.bench.comm import KIND_GRAD_ALLREDUCE, KIND_PP
from modelpar.bench.runner import make_rows, run_row

pytestmark = pytest.mark.slow


def _row(key, tmp_path, model="gpt-nano"):
    (spec,) = make_rows(model, [key], nproc=2, hybrid_nproc=4, global_batch_size=8, warmup=1, steps=1,
                        timeout_s=180)
    spec.track_memory = key != "ddp"
    res = run_row(spec, tmp_path)
    assert res["status"] == "ok", res
    return res


def test_ddp_gradient_allreduce_bytes_equal_4x_params(tmp_path):
    res = _row("ddp", tmp_path)
    nparams = res["num_params"]
    assert nparams > 100_000
    for rank in res["ranks"]:
        got = rank["comm"]["kinds"][KIND_GRAD_ALLREDUCE]["bytes"]
        assert abs(got - 4 * nparams) <= 0.01 * 4 * nparams, (got, 4 * nparams)
        assert rank["comm"]["kinds"][KIND_GRAD_ALLREDUCE]["recorded_s"] > 0
    assert res["samples_per_s"] > 0


def test_pipeline_timeline_has_every_microbatch(tmp_path):
    res = _row("pp-gpipe", tmp_path)
    m = res["plan"]["n_microbatches"]
    events = [e for r in res["ranks"] for e in r["timeline"]]
    for stage in range(2):
        for action in ("F", "B"):
            assert sorted(e["mb"] for e in events if e["stage"] == stage and e["action"] == action) == list(range(m))
    sends = res["ranks"][0]["comm"]["kinds"][KIND_PP]
    # stage 0 sends m activations (2 x 64 x 64 fp32 each) and receives m gradients of the same shape
    assert sends["bytes"] == 2 * m * (8 // m) * 64 * 64 * 4
    assert res["ranks"][0]["memory"]["total"] > 0
