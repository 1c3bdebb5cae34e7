"""Cutting models whose glue lives in their own forward (issue 12): Hugging Face Llama (GQA, RoPE), GPT-2
(tied head, position embeddings), ViT (``[:, 0]`` pooling), and a user model of that shape. One process:
the parts found by execution order, the wrapped forward against the untouched transformers model, the
chain of stages against the whole forward, stage state dicts, costs, split points and refusals. The
multi-rank parity rows are in tests/helpers/parity_cases.py (h-pp block)."""

import pytest
import torch
import torch.nn as nn
from helpers.hf_tiny import build

from modelpar.parallel import pipeline, stages
from modelpar.parallel.parts import block_costs, get_model_parts

EXPECTED = {   # (container, input part, output part)
    "llama": ("hf.model.layers", ["hf.model.embed_tokens"], ["hf.model.norm", "hf.lm_head"]),
    "gpt2": ("hf.transformer.h", ["hf.transformer.wte", "hf.transformer.wpe"], ["hf.transformer.ln_f", "hf.lm_head"]),
    "vit": ("hf.vit.layers", ["hf.vit.embeddings"], ["hf.vit.layernorm", "hf.classifier"]),
}


def _input(name, b=2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, 8, 8, generator=g) if name == "vit" else torch.randint(0, 128, (b, 16), generator=g)


def _chain(parts, ranges, x):
    n = len(ranges)
    mods = pipeline.build_stage_modules(parts, ranges, list(range(n)))
    try:
        with torch.no_grad():
            for m in mods:
                x = m(x)
    finally:
        for m in mods:
            stages.release(m)
    return x, mods


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parts_by_execution_order_and_exact_forward(name):
    m = build(name, dropout=0.0).eval()
    x = _input(name)
    parts = get_model_parts(m, example_input=x)
    cont, pre, post = EXPECTED[name]
    assert (parts.form, parts.container) == ("forward", cont)
    assert [p for p, _ in parts.pre] == pre and [p for p, _ in parts.post] == post   # rotary_emb: glue
    assert [p for p, _ in parts.blocks] == [f"{cont}.{i}" for i in range(4)]
    with torch.no_grad():      # the wrapper's forward is the untouched transformers model's, bit for bit
        ref = m.hf(pixel_values=x).logits if name == "vit" else m.hf(input_ids=x).logits
        assert torch.equal(m(x), ref)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_chain_of_stages_equals_the_whole_forward(name):
    """Two, three and four stages of one model (built and cut into parts once: the stage modules are
    built from the parts and released again for every split)."""
    m = build(name, dropout=0.0).eval()
    x = _input(name)
    parts = get_model_parts(m, example_input=x)
    with torch.no_grad():
        whole = m(x)
    full = set(m.state_dict())
    for ranges in ([(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]):
        got, mods = _chain(parts, ranges, x)
        assert torch.equal(got, whole), ranges
        # stage state dicts: original names; blocks partitioned; input part on the first, output part on the last
        keys = [set(s.state_dict()) for s in mods]
        assert set().union(*keys) == full, ranges
        for i, (k, (a, b)) in enumerate(zip(keys, ranges)):
            mine = {f"{parts.container}.{j}." for j in range(a, b)}
            blocks_here = {key for key in k if key.startswith(parts.container + ".")}
            assert all(any(key.startswith(p) for p in mine) for key in blocks_here), ranges
            assert all(any(key.startswith(p) for key in k) for p in mine), ranges
            assert any(key.startswith(EXPECTED[name][1][0]) for key in k) == (i == 0), ranges
            assert any(key.startswith(EXPECTED[name][2][-1]) for key in k) == (i == len(ranges) - 1), ranges
        assert all(not getattr(b, "_forward_hooks") for _, b in parts.blocks), ranges      # released
    with torch.no_grad():
        assert torch.equal(m(x), whole)           # building and releasing stages left the model as it was


def test_gpt2_tie_is_one_parameter_on_the_first_and_last_stage():
    m = build("gpt2", dropout=0.0)
    parts = get_model_parts(m, example_input=_input("gpt2"))
    first, last = pipeline.build_stage_modules(parts, [(0, 2), (2, 4)], [0, 1])
    assert "hf.transformer.wte.weight" in dict(first.named_parameters())
    assert "hf.lm_head.weight" not in dict(first.named_parameters())
    assert "hf.transformer.wte.weight" not in dict(last.named_parameters())   # a stub: no parameters
    assert dict(last.named_parameters())["hf.lm_head.weight"] is m.hf.transformer.wte.weight
    from modelpar.parallel import ties
    assert ties.stage_of(parts, [(0, 2), (2, 4)], "hf.lm_head.weight") == 1
    assert ties.stage_of(parts, [(0, 2), (2, 4)], "hf.transformer.wte.weight") == 0


def test_costs_are_profiled_flops_inside_the_forward():
    m = build("llama", dropout=0.0)
    x = _input("llama")
    parts = get_model_parts(m, example_input=x)
    pre, blk, post = stages.part_costs(parts, x, "flops")
    assert blk[0] == blk[1] == blk[2] == blk[3] > 0       # identical blocks cost the same
    b, t, d, v = 2, 16, 32, 128                            # the head: 2 b t d V matmul FLOPs + b t V outputs
    assert post[1] == 2 * b * t * d * v + b * t * v
    costs = block_costs(parts, "flops", x)
    assert costs[0] == blk[0] + sum(pre) and costs[-1] == blk[-1] + sum(post)
    assert len(stages.part_costs(parts, x, "time")[1]) == 4


def test_split_points_and_refusals():
    m = build("gpt2", dropout=0.0)
    x = _input("gpt2")
    parts = get_model_parts(m, ["hf.transformer.h.3"], example_input=x)
    assert stages.boundaries_from_split_points(parts, ["hf.transformer.h.3"], 2) == [3]
    with pytest.raises(ValueError, match=r"--split-points \['hf.transformer.h'\] name no block"):
        get_model_parts(m, ["hf.transformer.h"], example_input=x)
    with pytest.raises(ValueError, match="2 pipeline stages need 1 increasing block paths"):
        stages.boundaries_from_split_points(parts, ["hf.transformer.h.1", "hf.transformer.h.2"], 2)
    with pytest.raises(ValueError, match=r"--blocks 'hf.transformer' is not a non-empty"):
        get_model_parts(m, blocks="hf.transformer", example_input=x)


def test_meta_model_without_an_example():
    m = build("llama", device="meta")
    parts = get_model_parts(m)
    assert parts.num_blocks == 4 and [p for p, _ in parts.post] == ["hf.model.norm", "hf.lm_head"]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, scale):
        return torch.tanh(self.lin(h)) * scale


class _Trunk(nn.Module):
    def __init__(self, shared=None, between=False):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.shared, self.between = shared, between

    def forward(self, h, scale):
        for blk in self.layers:
            h = blk(h, scale=scale)
            if self.shared is not None:
                h = self.shared(h)
            if self.between:                    # glue between blocks: no stage cut can keep it
                h = h + 1
        return h


class GlueNet(nn.Module):
    """A user model not named in the issue: blocks two levels down, a position table added and a scale
    computed in the parent's forward and passed to every block, mean pooling at the end."""

    def __init__(self, shared=None, between=False):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.pos = nn.Embedding(6, 8)
        self.body = _Trunk(shared, between)
        self.out = nn.Linear(8, 3)

    def forward(self, x):                       # x (b, 6, 4)
        h = self.embed(x) + self.pos(torch.arange(x.shape[1]))
        h = self.body(h, scale=0.5 + h.shape[-1] / 16)
        return self.out(h.mean(1))


def test_a_user_model_with_glue_and_refusals():
    torch.manual_seed(0)
    m, x = GlueNet(), torch.randn(2, 6, 4)
    parts = get_model_parts(m, example_input=x)
    assert (parts.container, [p for p, _ in parts.pre], [p for p, _ in parts.post]) == ("body.layers", ["embed", "pos"], ["out"])
    got, _ = _chain(parts, [(0, 1), (1, 4)], x)
    with torch.no_grad():
        assert torch.equal(got, m(x))
    with pytest.raises(ValueError, match=r"\['body.shared'\] hold parameters and run while the blocks"):
        get_model_parts(GlueNet(shared=nn.LayerNorm(8)), example_input=x)
    odd = GlueNet(between=True)
    parts = get_model_parts(odd, example_input=x)
    with pytest.raises(ValueError, match="the pipeline stages chained differ from the whole forward by"):
        stages.check_chain(parts, [(0, 2), (2, 4)], x)


class TwoLinears(nn.Module):
    """A plain factory model with no repeated blocks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x).relu())


def make_two_linears():
    return TwoLinears()


def test_verify_refuses_bad_cuts_before_launch(capsys):
    """Exit 2 with one message and no process started: a model without blocks under pp, a split point
    that is not a block, a wrong number of split points, a --blocks path that is no container."""
    from helpers.hf_tiny import cli_args

    from modelpar.cli.verify import verify_main

    pp = ["--strategy", "pp", "--nproc", "2"]
    assert verify_main(["--model", f"{__file__}:make_two_linears", "--input-shape", "8", "--num-classes", "4", *pp]) == 2
    assert ("cannot find the blocks of TwoLinears" in capsys.readouterr().err)
    assert verify_main([*cli_args("gpt2"), *pp, "--split-points", "hf.transformer.h"]) == 2
    assert "--split-points ['hf.transformer.h'] name no block" in capsys.readouterr().err
    assert verify_main([*cli_args("gpt2"), *pp, "--split-points", "hf.transformer.h.1,hf.transformer.h.2"]) == 2
    assert "2 pipeline stages need 1 increasing block paths" in capsys.readouterr().err
    assert verify_main([*cli_args("llama"), *pp, "--blocks", "hf.model"]) == 2
    assert "--blocks 'hf.model' is not a non-empty" in capsys.readouterr().err


def test_train_preflight_checks_split_points():
    """``modelpar train --split-points`` is checked before launch, for the built-in GPT too."""
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import preflight

    cfg = dict(model="gpt-nano", strategy="pp", nproc=2)
    with pytest.raises(ValueError, match=r"--split-points \['blocks.9'\] name no block of GPT"):
        preflight(TrainConfig(**cfg, split_points="blocks.9"), 2)
    with pytest.raises(ValueError, match="2 pipeline stages need 1 increasing block paths"):
        preflight(TrainConfig(**cfg, split_points="blocks.0"), 2)
    assert preflight(TrainConfig(**cfg, split_points="blocks.1"), 2)[0].pp == 2


def _held_storages(root) -> dict[int, int]:
    """storage pointer -> bytes of every non-meta tensor reachable from ``root`` through modules,
    containers, plain objects' attributes and closures (hooks), what keeps memory allocated."""
    import gc
    import types

    seen, out, todo = set(), {}, [root]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                s = o.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(o, (dict, list, tuple, set, frozenset)):
            todo.extend(gc.get_referents(o))
        elif isinstance(o, types.FunctionType):
            todo.extend(c.cell_contents for c in (o.__closure__ or ()) if c.cell_contents is not None)
        elif hasattr(o, "__dict__"):
            todo.append(vars(o))
    return out


def _bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_later_stage_holds_only_its_own_parameters(name):
    """pp2: each stage references exactly the storages of its own parameters and buffers (an
    optimizer built over them holds the same), not the input part's: before, a later stage's stubs
    kept Llama's ``embed_tokens`` (16 KiB here; ~2 GiB in fp32 for Llama 3 8B) and GPT-2's ``wpe`` (8
    KiB) allocated. GPT-2's tied ``wte.weight``, read through the stub on the last stage, is its
    ``lm_head.weight``, the same Parameter."""
    import gc

    m = build(name, dropout=0.0)
    x = _input(name)
    parts = get_model_parts(m, example_input=x)
    first, last = pipeline.build_stage_modules(parts, [(0, 2), (2, 4)], [0, 1])
    embed = m.hf.get_input_embeddings().weight
    full = list(m.state_dict())
    keys = [list(st.state_dict()) for st in (first, last)]
    assert sorted(keys[0] + keys[1]) == sorted(full)       # what a checkpoint saves: none missing, none twice
    del m, parts
    gc.collect()
    for st in (first, last):
        opt = torch.optim.AdamW(st.parameters())
        own = _bytes([*st.parameters(), *st.buffers()])
        held = _held_storages(st)
        assert held == own, (sum(held.values()) - sum(own.values()), "bytes beyond the stage's own tensors")
        assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in st.parameters()}
    emb = last.hf.get_input_embeddings()
    assert not any(True for _ in emb.parameters()) and emb.weight.dtype == embed.dtype
    assert tuple(emb.weight.shape) == tuple(embed.shape)                 # attribute reads still answer
    if name == "gpt2":
        assert last.hf.transformer.wte.weight is last.hf.lm_head.weight is embed
        assert last.hf.transformer.wpe.weight.is_meta
        assert embed.untyped_storage().data_ptr() in _held_storages(last)
    else:
        assert emb.weight.is_meta and embed.untyped_storage().data_ptr() not in _held_storages(last)
    with torch.no_grad():                       # the chain still equals the whole forward
        h = first(x)
        assert last(h).shape[:2] == x.shape[:2]
    for st in (first, last):
        stages.release(st)
