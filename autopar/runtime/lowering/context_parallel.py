"""Attention whose query rows are split over ranks (context parallelism), keys and values whole.

Each rank attends from its rows of the query to every key: a row's output depends on that row and on
all of K and V, so a split query with K and V gathered whole is the same op (sharding/rules.sdpa_rule).
The plan gathers K and V before the op (all-gather; backward reduce-scatters their gradients, which
each rank holds only partly: the share its own rows contribute).

One thing changes with the split: `is_causal=True` masks by row *index*, and aten aligns that mask to
the top left of the local (L x S) block, as if this rank's rows were the sequence's first. A rank holding
rows [start, start + L) must let row i see keys 0 .. start + i instead. That mask is made here, from the
rank's chunk of the query (placement.chunk_span over the keys' length, known at run time), and the op runs
with it and `is_causal=False`.

What it costs: a mask rules out the kernels that skip the blocks above the diagonal, so a rank computes
its rows against every key (cost/terms prices that), and the ranks holding the sequence's end do the
most useful work. A later scheme (ring attention, head-tail chunks) balances it; docs/design/context-parallel.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import InputShapeError
from ...sharding.placement import chunk_span


def causal_rows_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, *, scale=None,
                          enable_gqa=False, chunk=0, num_chunks=1):
    """scaled_dot_product_attention(is_causal=True) for chunk `chunk` of `num_chunks` of a sequence's query
    rows, keys and values whole: row i of the chunk, row start + i of the sequence, sees keys 0 .. start + i.
    The start is taken from the keys' length (self-attention: as long as the whole query; sdpa_rule splits a
    causal query only then), so a batch of another length than the example's gets its own offsets.
    (aten's signature, so the call site keeps its arguments; `attn_mask` is None, as aten refuses a mask beside
    is_causal.)"""
    rows, keys = query.shape[-2], key.shape[-2]
    start, length = chunk_span(keys, num_chunks, chunk)
    if rows != length:   # the plan saw one sequence; a call's query and keys differ in length (dynamic dims)
        raise InputShapeError(
            f"causal attention split by its query's rows over {num_chunks} ranks needs queries and keys of one "
            f"sequence: this rank holds {rows} query rows, and chunk {chunk} of {keys} keys is {length} long")
    mask = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=False,
                                          scale=scale, enable_gqa=enable_gqa)

