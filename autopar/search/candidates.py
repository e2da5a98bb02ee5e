"""What a search returns: the costed candidates, the k fastest kept so far, and the summary.

Shared by the block search (search/search.py) and the chain search (search/chain_search.py), which
search.py dispatches to; kept apart so that neither imports the other's module for these types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.cost.stage import Config
from autopar.cost.step import Estimate


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One complete plan the search costed."""

    config: Config
    chunk_blocks: tuple[int, ...]
    estimate: Estimate
    ilp_status: str  # "OPTIMAL" proven (CP-SAT or enumeration), "DIRECT" where there is nothing to split (pp = 1)
    ilp_objective_s: float
    ilp_bound_s: float
    split_method: str = "direct"  # which exact solver gave the split: enumeration, parametric, cp-sat
    # Per-stage recompute: per pipeline rank (none, selective, full) block counts of a "mixed" config, else None
    recompute_blocks: tuple[tuple[int, int, int], ...] | None = None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    top: tuple[Candidate, ...]
    num_configs: int
    num_evaluated: int
    num_ilp_solved: int
    rejected: dict[str, int]
    elapsed_s: float
    optimal: bool  # every ILP proved optimal and no branch was cut by a time limit
    min_memory_bytes: float  # smallest peak memory of any costed plan (for "nothing fits" advice)
    min_memory_config: Config | None = None
    capacity_bytes: float = 0.0
    num_mixes_refined: int = 0  # per-stage recompute: top single-mode plans solved again as recompute mixes


@dataclass
class TopK:
    """The ``k`` fastest candidates offered so far, fastest first."""

    k: int
    items: list[Candidate] = field(default_factory=list)

    def threshold(self) -> float:
        return self.items[-1].step_time_s if len(self.items) >= self.k else math.inf

    def offer(self, cand: Candidate) -> None:
        self.items.append(cand)
        self.items.sort(key=lambda c: c.step_time_s)
        del self.items[self.k:]
