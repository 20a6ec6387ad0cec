"""Search: one strategy per node, the cheapest that fits memory, by ILP (greedy fallback).

Takes the priced `Problem` of cost/ and the roles a request allows each mesh axis
(classics.py: dp, fsdp, tp, ... as restrictions of one search space); hands on a `Solution`
(solution.py): a strategy index per node, the batch axes and how the search ended. For a
pipelined plan it also cuts the chosen layout into stages.

Reading order: classics.py, solution.py, formulation_vars.py and formulation.py (the integer program:
its variables and prices, then its memory rows and the whole built), ilp.py (it solved: HiGHS via scipy),
greedy.py (the fallback when HiGHS runs out of time), then the pipeline: pipeline.py (what a
pipelined plan is), stage_costs.py (each op's price per microbatch), stage_partition.py (the cut).
"""
