"""One search's memo tables: `PlannerCache`, created by `search.search_plans` (or by `estimate_step` /
`estimate_memory` / `rank_loads` when called alone) and passed down to every function that memoizes.

The planner keeps no module-level memo state: every table lives in one of these objects and dies with
it. Keys hold values only (degrees, sizes, a `loads.RankLoad`'s ``key``), never ``id()`` of an object;
an entry keyed by a rank load's ``key`` also holds that load and is used only for the same object
(``entry[0] is ld``), so two loads that happen to share a key cannot read each other's values.
"""

from __future__ import annotations


class PlannerCache:
    """Memo tables of one search (or one estimate) over one model profile and one hardware profile.

    Tables (plain dicts; keys described where they are filled):

    - ``block_terms``: `loads._block_terms` per (TP degree, sequence parallel, activation scale);
    - ``moments``: `loads._backward_moments` per (block records, own);
    - ``peaks``: `loads._scaled_peaks` per its arguments;
    - ``projections``: `memory._projections` per (block moments, reduce moments, mode);
    - ``links``: `comms._coll_sum`'s link terms per (degrees, axis, operation, ranks, in context);
    - ``buckets``: `comms.ddp_buckets` per (parameter sizes, element bytes);
    - ``comms``: `comms._comm_terms` per (rank load key, degrees, micro-batch, bytes, options);
    - ``load_times``: `cost._load_times` per (rank load key, micro-batch, precision, alone, kernel);
    - ``recompute_flops``: `recompute.recompute_flops_per_sample` per (mode, ac_every);
    - ``attn_rates``: `gpu.GpuPhysics.attention_flops` (forward, backward) per (sequence, head dimension,
      causal, kernel) (`gpu.gpu_load_times`);
    - ``waves``: `gpu.layer_wave_seconds` per (tokens per micro-batch, width, FFN, TP degree) (`cost.StepForm`);
    - ``mem_classes``: `grid.memory_class` per rank load key, numbering the contents in ``mem_class_ids``,
      and `grid._selection`'s class list per (rank list, checkpointing mode);
    - ``exposed``: `topk._exposed_floor`'s tables: (rank load, number of its content) per load object
      (by ``id``, the object kept to check it), the content numbers (what `comms._comm_terms` reads of
      a load for the exposed terms), and `topk._exposed_terms` per (content number, degrees, the step
      form's collective options).

    A cache serves one profile and one hardware: `bind` records them on first use and refuses others
    (the tables are not keyed by either).
    """

    __slots__ = ("profile", "hw", "block_terms", "moments", "peaks", "projections", "links", "buckets",
                 "comms", "load_times", "recompute_flops", "attn_rates", "waves",
                 "mem_classes", "mem_class_ids", "exposed")

    def __init__(self, profile=None, hw=None):
        self.profile = profile
        self.hw = hw
        self.block_terms: dict[tuple, tuple] = {}
        self.moments: dict[tuple, tuple] = {}
        self.peaks: dict[tuple, tuple] = {}
        self.projections: dict[tuple, tuple] = {}
        self.links: dict[tuple, tuple] = {}
        self.buckets: dict[tuple, list] = {}
        self.comms: dict[tuple, tuple] = {}
        self.load_times: dict[tuple, tuple] = {}
        self.recompute_flops: dict[tuple, float] = {}
        self.attn_rates: dict[tuple, tuple] = {}
        self.waves: dict[tuple, tuple] = {}
        self.mem_classes: dict[tuple, tuple] = {}
        self.mem_class_ids: dict[tuple, int] = {}
        self.exposed: tuple[dict, dict, dict] = ({}, {}, {})

    def bind(self, *, profile=None, hw=None) -> "PlannerCache":
        """Record the profile / hardware this cache serves (first use), and return ``self``.

        Raises:
            ValueError: the cache already serves another profile or hardware object.
        """
        if profile is not None:
            if self.profile is None:
                self.profile = profile
            elif self.profile is not profile:
                raise ValueError("this PlannerCache serves another model profile; create one cache per "
                                 "search (PlannerCache(profile, hw))")
        if hw is not None:
            if self.hw is None:
                self.hw = hw
            elif self.hw is not hw:
                raise ValueError(f"this PlannerCache serves hardware {self.hw.name!r}, not {hw.name!r}; "
                                 f"create one cache per search (PlannerCache(profile, hw))")
        return self
