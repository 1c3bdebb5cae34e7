"""Which Hugging Face causal-LM families modelpar can build, cut and plan: one row per model type.

For every model type transformers maps in ``AutoModelForCausalLM`` (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)
a tiny config is made (`tiny_overrides`: the type's config defaults with the usual size fields shrunk
where the config has them, hidden 64, 2 layers, 4 heads, 2 key/value heads, intermediate 128, vocabulary
256, 64 positions, 4 experts of which 2 per token; `OVERRIDES` for families whose fields must agree) and
these checks run, each on its own, each with a short reason when it does not pass:

1. ``build``: `modelpar.models.hf.build_hf` on the meta device (`load_config`'s checks included);
2. ``tp2``: `modelpar.parallel.tensor.tp_plan_for` at degree 2 and `validate_tp_plan` (what `verify`
   checks before launch): ok / refused (the ValueError's message) / error, with how many of the model's
   projections (``nn.Linear`` and transformers ``Conv1D``) the plan splits and the share of the
   parameters in split modules;
3. ``blocks``: `modelpar.parallel.parts.find_blocks` on the meta model (the container and the count);
4. ``pp2``: the cut `verify --pp 2` checks before launch: the model built on the CPU with real weights,
   its parts traced on 2 samples of 32 tokens (`get_model_parts`), split in two stages
   (`pipeline.split_stages`) and chained against the whole forward (`stages.check_chain`);
5. ``grads``: one backward of the CPU model's logits, built as `train` builds it (what the forward never
   reaches frozen: `modelpar.models.hf_unused`): every trainable parameter gets a gradient (the first
   step of every multi-rank run refuses parameters that get none, case C1);
6. ``profile``: the planner's `modelpar.cli.common.profile_for("hf:TYPE", cfg, 32, "fp32")`.

"refused" is modelpar's own one-line ValueError, "error" any other exception (a bug or a gap),
"badcfg" a failure that is transformers' own on this config (the build fails and so does transformers'
build of the type's default config; ``pp2``: transformers' own forward of the tiny model fails, so the
profile's failure on that family is most likely the same), "skip" a check that could not run because the
build failed, "timeout" a family that ran past
``--timeout`` seconds (each family runs in its own forked process, so one that hangs or crashes is its
own row).

    PYTHONPATH=$PWD python benchmarks/hf_family_sweep.py --out sweep.json          # every family
    PYTHONPATH=$PWD python benchmarks/hf_family_sweep.py --only llama,falcon -v    # a few, with tracebacks

Builds from configs only (no download). Prints the table and a summary count; ``--out`` writes the rows
as JSON (with each family's overrides, so a row can be rerun with ``--model-config``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
import traceback

SEQ = 32
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, POSITIONS, EXPERTS, TOP_K = 64, 2, 4, 2, 128, 256, 64, 4, 2
# (tiny value, config field names); a field is set only where the type's config has it (its to_dict())
SIZES = (
    (HIDDEN, ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim", "embedding_size", "embed_dim")),
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
            "n_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")),
    (HIDDEN // HEADS, ("head_dim", "attention_head_dim", "kv_channels")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
          "d_ff", "d_inner", "inner_hidden_size")),
    (FFN // 2, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")),
    (VOCAB, ("vocab_size",)),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")),
    (EXPERTS, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")),
    (TOP_K, ("num_experts_per_tok", "moe_topk", "top_k", "moe_k")),
    # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...)
    (32, ("q_lora_rank", "kv_lora_rank")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim")),
    (16, ("v_head_dim",)),
    (8, ("rotary_dim",)),                       # GPT-J, CodeGen: partial rotary within a head of 16
)
# families whose fields must agree beyond the generic sizes (each a --model-config of its own)
OVERRIDES: dict[str, dict] = {
    "deepseek_v2": {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "deepseek_v3": {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "deepseek_v32": {"n_group": 1, "topk_group": 1, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16},
    "glm_moe_dsa": {"n_group": 1, "topk_group": 1, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16},
    "dots3_note_text": {"num_key_value_heads": HEADS},       # its config wants as many k/v heads as heads
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]},
    "kolibri1_1": {"index_num_heads": KV_HEADS},
    "mamba2": {"head_dim": 2 * HIDDEN // HEADS},              # hidden x expand = heads x head_dim
    "zaya": {"num_experts_per_tok": 1},                      # its config takes one expert per token only
    "reformer": {"axial_pos_shape": [8, 8], "axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2]},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "zamba2": {"hybrid_layer_ids": [1], "mamba_headdim": HIDDEN // HEADS},
}


def _shrink(d: dict) -> dict:
    """The overrides of one config's dict ``d``: `SIZES`' fields it holds as ints, token ids beyond the
    vocabulary set to 0, and each nested sub-config (a dict with a ``model_type``: a multimodal model's
    ``text_config`` / ``vision_config``) shrunk the same way, passed whole."""
    out = {}
    for value, names in SIZES:                 # an int field, or one left None that a size derives from
        for n in names:
            if n in d and (d[n] is None or isinstance(d[n], int)) and not isinstance(d[n], bool):
                out[n] = value
    if d.get("multi_query"):                   # Falcon, GPT-BigCode: one key/value head, whatever these say
        for n in SIZES[3][1]:
            out.pop(n, None)
    layers = next((d[n] for n in SIZES[1][1] if isinstance(d.get(n), int)), None)
    for k, v in d.items():                     # per-layer lists (layer_types, ...): the first layers' entries
        if isinstance(v, list) and layers and len(v) == layers > LAYERS:
            out[k] = v[:LAYERS]
    for k, v in d.items():
        if k.endswith("_token_id") and isinstance(v, int) and v >= VOCAB:
            out[k] = 0
        if k.endswith("_token_id") and isinstance(v, list) and any(isinstance(i, int) and i >= VOCAB for i in v):
            out[k] = [0]
        if isinstance(v, dict) and "model_type" in v:       # its other fields: the sub-config's defaults
            out[k] = {"model_type": v["model_type"], **_shrink(v)}
    if "qk_rope_head_dim" in out and "head_dim" in out:    # MLA: the rotary part is the head_dim rotated
        out["head_dim"] = out["qk_rope_head_dim"]
    return out


def tiny_overrides(mtype: str) -> dict:
    """The ``--model-config`` of ``mtype``'s tiny config: `_shrink` of the type's default config, then
    `OVERRIDES`."""
    from transformers import AutoConfig

    out = _shrink(AutoConfig.for_model(mtype).to_dict())
    out.update(OVERRIDES.get(mtype, {}))
    return out


def _short(e: BaseException, n: int = 220) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split()) if not isinstance(e, ValueError) else " ".join(str(e).split())
    return s if len(s) <= n else s[:n - 3] + "..."


class _BadConfig(Exception):
    """The tiny config, not modelpar, is at fault: transformers' own model fails on it."""


def _own_default_fails(mtype: str) -> str:
    """Why transformers' own default config of ``mtype`` does not build on meta ("" when it does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(mtype))
    except Exception as e:  # noqa: BLE001
        return _short(e, 140)
    return ""


def _outcome(fn, verbose: bool):
    """``(status, detail)``: ok with ``fn()``'s detail, badcfg (`_BadConfig`), refused (ValueError) or
    error (anything else)."""
    try:
        return "ok", fn()
    except _BadConfig as e:
        return "badcfg", str(e)
    except ValueError as e:
        if verbose:
            traceback.print_exc()
        return "refused", _short(e)
    except Exception as e:  # noqa: BLE001 - every failure is a row, not a crash of the sweep
        if verbose:
            traceback.print_exc()
        return "error", _short(e)


def _is_projection(m) -> bool:
    import torch.nn as nn

    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def check_family(mtype: str, verbose: bool = False) -> dict:
    """One row: every check of the module docstring on ``mtype``'s tiny config."""
    import torch

    torch.set_num_threads(1)
    row = {"type": mtype, "overrides": None}
    try:
        row["overrides"] = cfg = tiny_overrides(mtype)
    except Exception as e:  # noqa: BLE001
        row["config"] = ("error", _short(e))
        cfg = {}
    from modelpar.models.hf import build_hf

    name = f"hf:{mtype}"
    t0 = time.perf_counter()
    status, model = _outcome(lambda: build_hf(name, cfg, device="meta"), verbose)
    row["build"] = (status, "" if status == "ok" else model)
    if status != "ok":
        own = _own_default_fails(mtype)
        if own:
            row["build"] = ("badcfg", f"{model} [transformers' default {mtype} config does not build either: {own}]")
        for k in ("tp2", "blocks", "pp2", "grads", "profile"):
            row[k] = ("skip", "build failed")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        return row
    row["params"] = sum(p.numel() for p in model.parameters())          # a tied weight once

    def tp():
        from modelpar.parallel.tensor import tp_kinds, tp_plan_for, validate_tp_plan

        plan = tp_plan_for(model, tp_degree=2)
        validate_tp_plan(model, plan, 2, seq_len=SEQ)
        kinds = tp_kinds(plan)
        mods = dict(model.named_modules())
        proj = [p for p, m in mods.items() if _is_projection(m)]
        split = [p for p in proj if p in kinds]
        split_ids = {id(q): q.numel() for p in kinds if p in mods for q in mods[p].parameters(recurse=False)}
        split_params = sum(split_ids.values())                 # a tied weight once
        vocab = any(s in ("rowwise_vocab", "colwise_vocab") for s in plan.values())
        return (f"{len(split)}/{len(proj)} projections split, {100 * split_params / row['params']:.0f}% of "
                f"params{', vocab parallel' if vocab else ''}")

    def blocks():
        from modelpar.parallel.parts import find_blocks

        cont, found = find_blocks(model)
        return f"{len(found)} x {type(found[0][1]).__name__} in {cont}"

    def pp():
        from modelpar.parallel import pipeline, stages
        from modelpar.parallel.parts import get_model_parts

        m = build_hf(name, cfg, device="cpu", dropout=0.0)
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                m(x)
        except Exception as e:  # noqa: BLE001 - not modelpar's: transformers' forward of the tiny config
            raise _BadConfig(f"transformers' own forward fails on this tiny config ({_short(e, 160)})") from e
        parts = get_model_parts(m, example_input=x)
        ranges = pipeline.split_stages(parts, 2)
        if parts.form == "forward":
            stages.check_chain(parts, ranges, x)
        return f"stages {ranges} of {parts.num_blocks} blocks"

    def grads():
        from modelpar.models.hf_unused import freeze_unreached

        m = build_hf(name, cfg, device="cpu", dropout=0.0)
        frozen = freeze_unreached(m, name, cfg, SEQ) is not None      # as `train` builds it
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        m(x).float().logsumexp(-1).mean().backward()
        none = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
        if none:                 # what the first step of every multi-rank run refuses (case C1)
            raise ValueError(f"{len(none)} trainable parameters get no gradient from the LM forward, e.g. "
                             f"{', '.join(none[:3])}")
        trainable = sum(p.requires_grad for p in m.parameters())
        return (f"{trainable} trainable parameters get gradients"
                + (f" ({len(m.unreached)} never reached, frozen)" if frozen else ""))

    def profile():
        from modelpar.cli.common import profile_for

        prof, _ = profile_for(name, cfg, SEQ, "fp32")
        return f"{len(prof.blocks)} blocks, {sum(b.fwd_flops for b in prof.blocks) / 1e6:.1f} MFLOP fwd"

    for key, fn in (("tp2", tp), ("blocks", blocks), ("pp2", pp), ("grads", grads), ("profile", profile)):
        row[key] = _outcome(fn, verbose)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _run_forked(mtypes: list[str], jobs: int, timeout: float, verbose: bool, log) -> list[dict]:
    """`check_family` of each type in its own forked child (at most ``jobs`` at once); a child that runs
    past ``timeout`` seconds is killed and its row says so, one that dies says how."""
    todo, running, rows = list(mtypes), {}, {}
    while todo or running:
        while todo and len(running) < jobs:
            mtype = todo.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:                                   # the child: one row as JSON on the pipe
                os.close(r)
                try:
                    out = json.dumps(check_family(mtype, verbose)).encode()
                except BaseException as e:  # noqa: BLE001
                    out = json.dumps({"type": mtype, "build": ("error", _short(e))}).encode()
                with os.fdopen(w, "wb") as f:
                    f.write(out)
                os._exit(0)
            os.close(w)
            running[r] = (mtype, pid, time.monotonic(), bytearray())
        ready, _, _ = select.select(list(running), [], [], 0.5)
        for r in ready:
            chunk = os.read(r, 1 << 16)
            if chunk:
                running[r][3].extend(chunk)
                continue
            mtype, pid, _, buf = running.pop(r)
            os.close(r)
            _, status = os.waitpid(pid, 0)
            try:
                rows[mtype] = json.loads(bytes(buf))
            except json.JSONDecodeError:
                rows[mtype] = {"type": mtype, "build": ("error", f"the check process died (wait status {status})")}
            log(rows[mtype])
        now = time.monotonic()
        for r, (mtype, pid, start, _) in list(running.items()):
            if now - start > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(r)
                running.pop(r)
                rows[mtype] = {"type": mtype, "build": ("timeout", f"ran past {timeout:.0f} s")}
                log(rows[mtype])
    return [rows[t] for t in mtypes]


CHECKS = ("build", "tp2", "blocks", "pp2", "grads", "profile")


def table(rows: list[dict]) -> str:
    """Markdown: one row per family, one column per check (status), then each failure's reason."""
    lines = ["| family | " + " | ".join(CHECKS) + " | tp2 split |", "|---" * (len(CHECKS) + 2) + "|"]
    for row in rows:
        cells = [row.get(k, ("timeout", ""))[0] for k in CHECKS]
        tp = row.get("tp2", ("", ""))
        lines.append(f"| {row['type']} | " + " | ".join(cells) + f" | {tp[1] if tp[0] == 'ok' else ''} |")
    lines += ["", "Reasons (every check that is not ok or skip):", ""]
    for row in rows:
        for k in CHECKS:
            st, why = row.get(k, ("timeout", ""))
            if st not in ("ok", "skip"):
                lines.append(f"- {row['type']} {k}: {st}: {why}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per check: how many families are ok / refused / error / skip / timeout."""
    out = [f"{len(rows)} families"]
    for k in CHECKS:
        counts: dict[str, int] = {}
        for row in rows:
            st = row.get(k, ("timeout", ""))[0]
            counts[st] = counts.get(st, 0) + 1
        out.append(f"  {k:8s} " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])))
    all_ok = sum(all(row.get(k, ("",))[0] == "ok" for k in CHECKS) for row in rows)
    out.append(f"  every check ok: {all_ok}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--jobs", type=int, default=2, help="families checked at once (forked processes)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per family before it is killed")
    ap.add_argument("--out", default="", help="write the rows and the summary as JSON here")
    ap.add_argument("--table", default="", help="write the Markdown table here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the traceback of every failure")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401  (imported once, before the forks)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import modelpar.models.hf  # noqa: F401

    mtypes = [t.strip() for t in args.only.split(",") if t.strip()] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.perf_counter()

    def log(row):
        cells = " ".join(f"{k}={row.get(k, ('timeout',))[0]}" for k in CHECKS)
        print(f"{row['type']:28s} {cells} ({row.get('seconds', '-')} s)", file=sys.stderr, flush=True)

    rows = _run_forked(mtypes, max(1, args.jobs), args.timeout, args.verbose, log)
    text = table(rows)
    print(text)
    print()
    print(summary(rows))
    print(f"transformers {transformers.__version__}, {time.perf_counter() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"transformers": transformers.__version__, "seq_len": SEQ, "rows": rows,
                       "summary": summary(rows)}, f, indent=1)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n\n" + summary(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
