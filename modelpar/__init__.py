"""modelpar: train PyTorch models across devices with every standard form of parallelism, pick the
form automatically, and measure what it costs.

Public API:
    ParallelPlan, plan_for_strategy      -- modelpar.plan
    parallelize, ParallelModel           -- modelpar.parallel.compose
    build_mesh, init_distributed         -- modelpar.parallel.mesh
    TrainConfig, train                   -- modelpar.train
"""

from modelpar.plan import ParallelPlan, plan_for_strategy

__version__ = "0.1.0"
__all__ = ["ParallelPlan", "plan_for_strategy", "__version__"]
