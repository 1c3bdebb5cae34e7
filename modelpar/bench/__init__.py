"""`modelpar bench`: measure strategies on the user's model and machine.

- `runner`: one launch (through ``torch.distributed.run``) per strategy row; warm-up, timed steps, one
  profiled step (communication, pipeline timeline) and one memory-tracked step per row.
- `comm`: the communication profile of a step, read from torch.profiler events.
- `fit`: which model sizes fit on how many devices, from the planner's memory model.
- `plots`: throughput, memory by part, pipeline timelines (matplotlib, Agg).
- `suite`: the bench run and its report (``modelpar bench``: `modelpar.cli.bench`).
"""
