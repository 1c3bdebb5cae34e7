"""Cases C5 and C6: pipeline inputs and stage boundaries are checked before training.

Tier 1 (no processes): the boundary dry run flattens dicts / tuples of tensors and names the stage
and field of anything else. Tier 2 (in the 2-rank parity launch): every rank raises the same
ValueError, before any schedule runs.
"""

import pytest
import torch
import torch.nn as nn
from helpers.parity_cases import CASES, DictNet

from modelpar.parallel.parts import get_model_parts
from modelpar.parallel.pipeline import StageModule, check_stage_boundaries


def test_dict_of_tensors_is_flattened_and_rebuilt():
    model = DictNet(4)
    parts = get_model_parts(model)
    ranges = [(0, 2), (2, 4)]
    x = torch.randn(3, 32)
    specs = check_stage_boundaries(parts, ranges, x)
    assert specs[0] is not None                    # a dict crosses: carried as its leaves
    s0 = StageModule(parts, 0, 2, is_first=True, is_last=False, out_spec=specs[0])
    s1 = StageModule(parts, 2, 4, is_first=False, is_last=True, in_spec=specs[0])
    sent = s0(x)
    assert isinstance(sent, tuple) and all(torch.is_tensor(t) for t in sent) and len(sent) == 2
    torch.testing.assert_close(s1(*sent), model(x))


def test_plain_tensor_boundary_needs_no_spec():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert check_stage_boundaries(get_model_parts(seq), [(0, 2), (2, 3)], torch.randn(2, 4)) == [None]


def test_int_in_boundary_names_stage_and_field():
    parts = get_model_parts(DictNet(4, with_int=True))
    with pytest.raises(ValueError, match=r"pipeline stage 0 .*field \['n'\] is int"):
        check_stage_boundaries(parts, [(0, 2), (2, 4)], torch.randn(2, 32))


def test_tuple_with_string_is_refused():
    class Tag(nn.Module):
        def forward(self, x):
            return (x, "tag")

    class Use(nn.Module):
        def forward(self, t):
            return t[0] * 2

    seq = nn.Sequential(nn.Linear(3, 3), Tag(), Use(), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"stage 0 .*field \[1\] is str"):
        check_stage_boundaries(get_model_parts(seq), [(0, 2), (2, 4)], torch.randn(2, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name,needle", [("c6-dict-int-pp2", "field ['n'] is int"),
                                         ("c5-batch10-mb4-pp2", "local batch size 10 is not divisible by "
                                                                "n_microbatches=4"),
                                         ("c14-selective-mlp", "block '0' (Sequential) has none")])
def test_same_error_on_every_rank(name, needle, dist_results):
    res = dist_results(CASES[name].world).get(name)
    assert res is not None and "error" not in res, res
    msgs = res["messages"]
    assert len(msgs) == CASES[name].world and len(set(msgs)) == 1, msgs
    assert needle in msgs[0], msgs[0]


def test_dry_runs_draw_no_random_numbers_and_restore_train_mode():
    from modelpar.models import build_gpt
    from modelpar.parallel.parts import measure_part_costs

    model = build_gpt("gpt-nano", seq_len=16, dropout=0.1)
    model.train()
    parts = get_model_parts(model)
    x = torch.zeros(2, 16, dtype=torch.long)
    state = torch.get_rng_state()
    check_stage_boundaries(parts, [(0, 1), (1, 2)], x)
    measure_part_costs(parts, x)
    assert torch.equal(state, torch.get_rng_state())
    assert all(m.training for m in model.modules())


class _DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, d):
        return {"h": self.lin(d["h"])}


class _DictThroughForward(nn.Module):
    """Blocks that take and return dicts, the model's own forward wrapping and unwrapping them."""

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(4, 8), nn.ModuleList(_DictBlock() for _ in range(3)), nn.Linear(8, 2)

    def forward(self, x):
        d = {"h": self.inp(x)}
        for b in self.blocks:
            d = b(d)
        return self.out(d["h"])


def test_blocks_fed_a_dict_by_the_forward_say_what_they_got_and_what_to_do():
    """A block whose first input is a dict (not the hidden-state tensor a stage cut inside the model's
    forward passes on) is refused naming what it got and the ways out; the ModuleList probe that ran the
    children in order (the dict's key indexing a tensor) no longer leaks torch's warning about it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"block blocks\.0 gets a dict as its first input, not a tensor: .*"
                                             r"sequential form .*case C6"):
            get_model_parts(_DictThroughForward(), example_input=torch.zeros(2, 4))
