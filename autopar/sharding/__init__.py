"""Sharding: what layouts each node of the graph may take, and what moving between them costs in collectives.

Takes `Captured` and a mesh; hands on every node's candidate strategies (strategies.py) and
the collectives that turn one placement into another (redistribute.py). Nothing here prices
anything in seconds or bytes: that is cost/.

Reading order: placement.py (R, S(d), P per mesh axis), rules.py (one declaration per op of
which dims may split; see its imports for the op families), strategies.py (the rules
enumerated over the mesh's axes), redistribute.py (placement -> placement as collectives),
local_ops.py (what running an op on a rank's shards takes under a strategy, which the plan records).
"""
