"""The planner's accuracy harness: measure real runs (peak tensor memory by part, step time) of the
layouts the planner predicts, launched through `modelpar.launch`. Beside the planner, not in it: it
builds models, lays them out with `parallelize` and starts processes (`modelpar.measure.runs`)."""

from modelpar.measure.runs import Case, launch, measure_memory, planner_boundaries, run_cases, time_cases

__all__ = ["Case", "launch", "measure_memory", "planner_boundaries", "run_cases", "time_cases"]
