"""Cost: every candidate strategy priced in seconds and bytes, numerically and as sympy expressions.

Takes `Captured` and the strategies of sharding/; hands on a `Problem` (problem.py): the
candidates, the edges between them and memoised prices that the solvers in search/ read,
and `predict` (predict.py), which prices the one choice a search returns. The hardware
numbers (FLOP/s, link bandwidths, collective algorithms) live in the top-level cost_models
package; this package says which of them each node and edge pays.

Reading order: precision.py (bytes per parameter), activations.py (bytes autograd keeps),
liveness.py (what is alive at each op), checkpointing.py (which stacks may be recomputed, at
what price), terms.py (a strategy's and an edge's cost), problem.py, predict.py.
"""
