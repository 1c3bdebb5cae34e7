"""The end-of-run weight gather (`modelpar.train.gather.gather_full_state_dict`: the run folder's
model.safetensors, verify's parity states) makes one tensor whole at a time and keeps host copies on
rank 0 only: under FSDP, DDP and a 2-stage pipeline, rank 1's peak host memory during the gather stays
under 4 of the model's largest tensors (the all-gather's own buffers: it peaks at ~3 under FSDP; the
model is 16 of them) and rank 0's under the model plus that, and rank 0 gets the model's exact state. (The gather it replaced made every tensor whole on every rank at once and
copied it to the host there; under a pipeline it pickled each stage through `gather_object`: rank 1
peaked at 1-2 models.) The scenarios ride the session's first 2-rank launch (`helpers.workers`)."""

import pytest

from helpers import workers

PLANS = {"fsdp": {"dp_shard": 2}, "ddp": {"dp_replicate": 2},
         "pp": {"pp": 2, "n_microbatches": 2, "pp_schedule": "gpipe"}}


def _specs(work):
    return [{"name": f"gather_{k}", "kind": "call", "fn": "helpers.gather_case:gather", "plan": plan}
            for k, plan in PLANS.items()] + [
        {"name": "shapes_fsdp", "kind": "call", "fn": "helpers.gather_case:shapes", "plan": {"dp_shard": 2},
         "work": str(work)}]


workers.ride("gather2", 2, _specs, module=__file__)
workers.ride("gather4", 4, lambda work: [{"name": "shapes_pp_fsdp", "kind": "call", "fn": "helpers.gather_case:shapes",
                                          "plan": {"pp": 2, "dp_shard": 2, "n_microbatches": 2,
                                                   "pp_schedule": "gpipe"}, "work": str(work)}], module=__file__)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(PLANS))
def test_gather_keeps_one_whole_tensor_at_a_time_and_copies_on_rank0_only(layout):
    r = workers.rider_results("gather2")[f"gather_{layout}"]
    assert not r["errors"], r["errors"]
    res = r["result"]
    print(layout, res["ranks"], f"model {res['model_mb']:.1f} MB")      # shown with -s
    assert res["equal"] and not res["missing"], res
    r0, r1 = sorted(res["ranks"], key=lambda x: x["rank"])
    model_mb = res["model_mb"]
    largest = 4 * 1024 * 1024 * 4 / 2**20          # a Linear(1024, 1024)'s weight, MB
    assert r0["keys"] == 32 and r1["keys"] == 0, res["ranks"]
    assert r1["peak_mb"] < 4 * largest, (layout, res["ranks"], model_mb)
    assert r0["peak_mb"] < model_mb + 4 * largest, (layout, res["ranks"], model_mb)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tag,name,sizes", [("gather2", "shapes_fsdp", []), ("gather4", "shapes_pp_fsdp", [2])])
def test_checkpoint_parameter_list_gathers_over_the_pipeline_group_only(tag, name, sizes):
    """The parameter list each checkpoint records (and each resume checks): the ranks of one stage name the
    same parameters with global shapes, so a run without a pipeline gathers nothing and a pipeline gathers
    over its pipeline group (2 of the 4 ranks), not the world (whose ``all_gather_object`` pads every
    rank's pickle to the largest: ~3,072 copies on each rank at 3,072 ranks)."""
    r = workers.rider_results(tag)[name]
    assert not r["errors"], r["errors"]
    for rank in r["result"]["ranks"]:
        assert rank["whole"] and rank["group_sizes"] == sizes, rank
