"""Pipeline parallel with `torch.distributed.pipelining`.

The model's blocks are cut into ``pp x virtual_stages`` contiguous stages (balanced by parameter
count unless boundaries are given); the input part goes with the first stage and the output part with
the last. Each stage module registers the original modules under their original paths, so stage
state dicts use the same names as the whole model. The local batch is split into ``n_microbatches``
micro-batches and run by one of torch's schedules (GPipe: Huang et al. 2019; 1F1B: Narayanan et al.
2019, PipeDream-Flush; interleaved 1F1B: Narayanan et al. 2021; zero bubble: Qi et al. 2024).

Loss scaling is done in the loss function, not by the schedule (``scale_grads=False``): each
micro-batch loss is divided by ``n_microbatches x accumulation steps`` for a mean loss, so gradients
summed over micro-batches and accumulated schedule steps equal one device's (case C4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from modelpar.parallel.parts import ModelParts, balanced_partition, block_param_costs, stage_ranges

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def get_schedule_class(name: str):
    """The torch schedule class for a modelpar schedule name.

    Raises:
        ValueError: unknown name (listing the valid ones), or a schedule the installed torch lacks.
    """
    import torch.distributed.pipelining.schedules as sched

    if name not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULE_CLASSES)}")
    cls = getattr(sched, SCHEDULE_CLASSES[name], None)
    if cls is None:
        raise ValueError(f"pipeline schedule {name!r} needs a newer torch than {torch.__version__}")
    return cls


class StageModule(nn.Module):
    """One pipeline stage: (input part) -> blocks[a:b] -> (output part), original paths kept."""

    def __init__(self, parts: ModelParts, first: int, end: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self._order: list[str] = []
        entries = (parts.pre if is_first else []) + parts.blocks[first:end] + (parts.post if is_last else [])
        for path, mod in entries:
            self._register_path(path, mod)
            self._order.append(path)

    def _register_path(self, path: str, mod: nn.Module) -> None:
        owner: nn.Module = self
        *heads, leaf = path.split(".")
        for h in heads:
            if not hasattr(owner, h) or not isinstance(getattr(owner, h), nn.Module):
                owner.add_module(h, nn.ModuleDict())
            owner = getattr(owner, h)
        owner.add_module(leaf, mod)

    def forward(self, x):
        for path in self._order:
            x = self.get_submodule(path)(x)
        return x


def stage_indices(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices held by one pipeline rank: round-robin (``r, r+p, ...``) or V-shape for the
    ZBV / DualPipeV schedules (``r`` and ``2p-1-r``)."""
    if schedule in ("zbvzerobubble", "dualpipev"):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def split_stages(parts: ModelParts, num_stages: int, boundaries=None, block_costs=None) -> list[tuple[int, int]]:
    """[start, end) block range of each of ``num_stages`` stages.

    Raises:
        ValueError: more stages than blocks.
    """
    if num_stages > parts.num_blocks:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {parts.num_blocks} blocks")
    if boundaries is None:
        boundaries = balanced_partition(block_costs or block_param_costs(parts), num_stages)
    return stage_ranges(parts.num_blocks, boundaries)


def build_stage_modules(parts: ModelParts, ranges: list[tuple[int, int]], indices: list[int]) -> list[StageModule]:
    n = len(ranges)
    return [StageModule(parts, *ranges[i], is_first=(i == 0), is_last=(i == n - 1)) for i in indices]


def build_schedule(stage_modules: list[nn.Module], indices: list[int], num_stages: int, *, schedule: str,
                   n_microbatches: int, loss_fn: Callable, device: torch.device, pp_group):
    """Wrap stage modules in `PipelineStage` objects and build the torch schedule.

    ``loss_fn(output, target)`` must already carry the 1 / (micro-batches x accumulation) factor for a
    mean loss; the schedule does not rescale gradients.
    """
    from torch.distributed.pipelining import PipelineStage

    cls = get_schedule_class(schedule)
    stages = [PipelineStage(m, i, num_stages, device, group=pp_group) for m, i in zip(stage_modules, indices)]
    if len(stages) == 1 and schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
