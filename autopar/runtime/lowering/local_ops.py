"""Which callable runs a captured op on this rank's shards, and with what arguments.

Almost always the op itself, on the local tensors. Two ops change with their split:
- an embedding whose table is split along the vocabulary looks up only this rank's rows
  (vocab_parallel.vocab_parallel_embedding);
- a causal attention whose query rows are split masks by its rows' global positions
  (context_parallel.causal_rows_attention).
The plan records which (sharding/local_ops.LocalOp, in planning/lowering.Lowering.ops): the rewriter (rewrite.py)
runs `run_local` on that record, and the rules' property test (tests/test_rules.py) `local_call` on the same
fields derived from the node as planning derives them, so the test runs what the runtime runs.
"""
from __future__ import annotations

import torch.fx as fx

from ...sharding.local_ops import LocalOp, vocab_lookup
from ...sharding.rules import causal_rows_split_axes
from ..collectives import rank_chunk
from .context_parallel import causal_rows_attention
from .vocab_parallel import lookup_target


def local_call(node: fx.Node, strategy, coords, axis_sizes, args: tuple, kwargs: dict) -> tuple:
    """(callable, args, kwargs) that compute this rank's shard of `node`'s output under `strategy`, from
    `args` and `kwargs` (the op's own, its tensors already local). `coords`: this rank's place on each mesh
    axis."""
    op = LocalOp(vocab_lookup=vocab_lookup(node, strategy, axis_sizes),
                 causal_rows=causal_rows_split_axes(node, strategy, axis_sizes))
    return run_local(op, node.target, coords, axis_sizes, args, kwargs)


def run_local(op: LocalOp, target, coords, axis_sizes, args: tuple, kwargs: dict) -> tuple:
    """(callable, args, kwargs) that run op `target` as the plan's record `op` says, on this rank's shards."""
    if op.causal_rows:
        chunk, num_chunks = rank_chunk(op.causal_rows, coords, axis_sizes)
        return causal_rows_attention, args, {**kwargs, "chunk": chunk, "num_chunks": num_chunks}
    target, extra = lookup_target(op.vocab_lookup, target, coords, axis_sizes)
    if extra:  # vocab_parallel_embedding(weight, indices, start, local padding_idx)
        return target, (args[0], args[1]) + extra, {}
    return target, args, kwargs
