"""The plan file (``plan.json``): one format for a resolved layout and its batch terms.

Written by ``modelpar plan --explain K --json``, ``modelpar estimate --json`` and into every run
folder by ``modelpar train``; read by ``train --plan FILE``, ``verify --plan FILE`` and
``estimate --plan FILE``. A flat JSON object:

- every `ParallelPlan` field (any subset; missing fields take their defaults), e.g.
  ``{"dp_shard": 2, "tp": 2, "sequence_parallel": true}``;
- optionally the batch terms: ``global_batch_size`` (samples per optimizer step),
  ``local_batch_size`` (samples per forward/backward on one data-parallel rank), and the derived
  ``micro_batch_size`` (samples per pipeline micro-batch, = local under no pipeline) and
  ``accum_steps`` (= global / (local x dp)), which are checked when present;
- optionally ``world_size`` (checked against the degrees' product), ``format_version`` (1),
  free-text ``source`` (who chose the plan, and why) and ``predicted`` (what ``estimate --json``
  predicted for it: step time, MFU, HFU, memory by part; informative, ignored when read).

Unknown keys are an error naming them, so a misspelt field never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from modelpar.plan import ParallelPlan, gradient_accumulation_steps

FORMAT_VERSION = 1
BATCH_KEYS = ("global_batch_size", "local_batch_size", "micro_batch_size", "accum_steps")
INFO_KEYS = ("world_size", "format_version", "source", "predicted")


@dataclass(frozen=True)
class PlanFile:
    """A plan with (optionally) its batch terms. Units: samples."""

    plan: ParallelPlan
    global_batch_size: int | None = None
    local_batch_size: int | None = None
    source: str = ""

    @property
    def micro_batch_size(self) -> int | None:
        if self.local_batch_size is None:
            return None
        return self.local_batch_size // (self.plan.n_microbatches if self.plan.pp > 1 else 1)

    @property
    def accum_steps(self) -> int | None:
        if self.global_batch_size is None or self.local_batch_size is None:
            return None
        return gradient_accumulation_steps(self.global_batch_size, self.local_batch_size, self.plan.dp)

    def to_dict(self) -> dict:
        d = {**self.plan.to_dict(), "world_size": self.plan.world_size, "format_version": FORMAT_VERSION}
        if self.global_batch_size is not None:
            d["global_batch_size"] = self.global_batch_size
        if self.local_batch_size is not None:
            d["local_batch_size"] = self.local_batch_size
            d["micro_batch_size"] = self.micro_batch_size
            if self.global_batch_size is not None:
                d["accum_steps"] = self.accum_steps
        if self.source:
            d["source"] = self.source
        return d

    def write(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return Path(path)


def parse_plan_file(d: dict, *, where: str = "plan file") -> PlanFile:
    """A `PlanFile` from the JSON object ``d``.

    Raises:
        ValueError: unknown keys (listed with the valid ones), a ``format_version`` newer than this
            code reads, or derived terms (``world_size``, ``micro_batch_size``, ``accum_steps``) that
            disagree with the plan and batch they are derived from.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object of ParallelPlan fields, got {type(d).__name__}")
    plan_keys = {f.name for f in dataclasses.fields(ParallelPlan)}
    unknown = sorted(set(d) - plan_keys - set(BATCH_KEYS) - set(INFO_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid: the ParallelPlan fields {sorted(plan_keys)}, "
                         f"the batch terms {list(BATCH_KEYS)} and {list(INFO_KEYS)}")
    version = d.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"{where}: format_version={version!r}; this modelpar reads version {FORMAT_VERSION}")
    plan = ParallelPlan.from_dict({k: v for k, v in d.items() if k in plan_keys})
    pf = PlanFile(plan, d.get("global_batch_size"), d.get("local_batch_size"), d.get("source", ""))
    checks = [("world_size", plan.world_size)]
    if pf.local_batch_size is not None:
        checks.append(("micro_batch_size", pf.micro_batch_size))
        if pf.global_batch_size is not None:
            checks.append(("accum_steps", pf.accum_steps))
    for key, derived in checks:
        if key in d and d[key] != derived:
            raise ValueError(f"{where}: {key}={d[key]} disagrees with the plan and batch it is derived from "
                             f"({derived}); fix or remove it")
    return pf


def read_plan_file(spec: str | Path) -> PlanFile:
    """Read a plan file, or JSON text starting with ``{`` (as ``--plan '{"tp": 2}'`` accepts).

    Raises:
        ValueError: no such file, invalid JSON, or what `parse_plan_file` raises.
    """
    text = str(spec)
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--plan {text!r}: no such file (give a plan.json or JSON text such as '{{\"tp\": 2}}')")
        text, where = path.read_text(), str(path)
    else:
        where = "--plan"
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    return parse_plan_file(d, where=where)
