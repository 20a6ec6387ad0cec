"""Lowering: the plan turned into this rank's fx graph.

rewrite.py (the global graph -> the local graph, every collective inserted), regather.py (what backward
gathers again instead of keeping whole: FSDP weights, sequence-parallel activations), recompute.py
(checkpointed blocks run again in backward), vocab_parallel.py (the embedding and cross-entropy over a
split vocabulary), input_shapes.py (the shapes a call may take).
"""
