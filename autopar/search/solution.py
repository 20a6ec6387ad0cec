"""What a search returns: one strategy per node, the batch axes, and how the search ended.

The status strings live here, not in a solver, because the plan reports them (planning/result.py)
and must not depend on which solver ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OPTIMAL = "optimal"
TIME_LIMIT = "time limit reached"
INFEASIBLE = "infeasible"
GREEDY = "greedy"                        # HiGHS ran out of time; the greedy's plan, gap to HiGHS's bound
GREEDY_NO_BOUND = "greedy (no bound)"    # ... and no lower bound was found to measure the gap against
# a search not branched on: its relaxation proved it no faster than a plan found, within the gap (ilp._cheapest)
PRUNED = "pruned by its bound"


@dataclass
class Solution:
    choice: dict[str, int]          # node -> index into its strategies
    batch_axes: tuple               # axes that split the batch
    objective: float                # predicted seconds (search's cost model)
    solve_seconds: float
    status: str
    num_variables: int = 0
    num_constraints: int = 0
    mip_gap: float = 0.0            # proven distance from the optimum when HiGHS stopped
    build_seconds: float = 0.0      # building the ILP (edge costs, rows), before HiGHS
    # {stack path: 'selective' or 'full'}: stacks whose blocks' attention cores, or whole blocks, recompute
    checkpointed: dict = field(default_factory=dict)
    regather_activations: bool = False   # activations gathered whole for an op that keeps them: kept as shards
    reshard_after_forward: bool = True   # FSDP weights kept for backward: as shards (True) or whole (False)
    memory: float = 0.0              # bytes per device as the search measures the plan (ilp.solve)
    context: str = ""                # auto: whether it tried a context axis, and why it took it or not
    named: str = ""                  # auto: the named strategies its answer was held against (planner._against_named)
    priced: float = 0.0              # the objective as the search minimised it, its tie-break included (ilp._finish)
