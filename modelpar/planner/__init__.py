"""The planner: profile a model without weights, predict memory and step time per plan, search.

Pure Python over numbers (no process group). Entry points: `profile_model`, `estimate_memory`,
`estimate_step`, `search_plans` / `choose_plan` (``--strategy auto``), `rule_plan` (``--strategy
rules``). The command line lives in `modelpar.cli`, calibration in `modelpar.calibrate`, the
accuracy harness in `modelpar.measure`: none of them is imported from here.
"""

from modelpar.planner.cost import StepEstimate, estimate_step, hfu, mfu
from modelpar.planner.hardware import BUILTIN, Hardware, cpu_profile, get_hardware, load_profile, save_profile
from modelpar.planner.memory import Batch, MemoryEstimate, estimate_memory
from modelpar.planner.profile import BlockProfile, ModelProfile, profile_model
from modelpar.planner.rules import rule_plan
from modelpar.planner.search import Candidate, SearchReport, choose_plan, search_plans

__all__ = ["BUILTIN", "Batch", "BlockProfile", "Candidate", "Hardware", "MemoryEstimate", "ModelProfile",
           "SearchReport", "StepEstimate", "choose_plan", "cpu_profile", "estimate_memory", "estimate_step",
           "get_hardware", "hfu", "load_profile", "mfu", "profile_model", "rule_plan", "save_profile",
           "search_plans"]
