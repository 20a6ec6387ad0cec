"""Which callable runs a captured op on this rank's shards, and with what arguments.

Almost always the op itself, on the local tensors. Two ops change with their split:
- an embedding whose table is split along the vocabulary looks up only this rank's rows
  (vocab_parallel.vocab_parallel_embedding);
- a causal attention whose query rows are split masks by its rows' global positions
  (context_parallel.causal_rows_attention).
The rewriter (rewrite.py) and the rules' property test (tests/test_rules.py) both ask here, so the test
runs what the runtime runs.
"""
from __future__ import annotations

import torch.fx as fx

from ...sharding.rules import causal_rows_split_axes
from .context_parallel import causal_rows_attention, row_chunk
from .vocab_parallel import local_target


def local_call(node: fx.Node, strategy, coords, axis_sizes, args: tuple, kwargs: dict) -> tuple:
    """(callable, args, kwargs) that compute this rank's shard of `node`'s output under `strategy`, from
    `args` and `kwargs` (the op's own, its tensors already local). `coords`: this rank's place on each mesh
    axis."""
    if causal_rows_split_axes(node, strategy, axis_sizes):
        chunk, num_chunks = row_chunk(node, strategy, coords, axis_sizes)
        return causal_rows_attention, args, {**kwargs, "chunk": chunk, "num_chunks": num_chunks}
    target, extra = local_target(node, strategy, coords, axis_sizes)
    if extra:  # vocab_parallel_embedding(weight, indices, start, local padding_idx)
        return target, (args[0], args[1]) + extra, {}
    return target, args, kwargs
