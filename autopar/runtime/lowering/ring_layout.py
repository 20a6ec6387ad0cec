"""The rows a ring attention's rank works on, and the one message it sends at a time.

A causal ring is balanced by where its rows sit: in 2n chunks, a rank holding chunks c and 2n-1-c does the
same causal work as every other. The model's tensors keep the contiguous layout (rank r holds chunks 2r and
2r+1), so the ring swaps one chunk of query rows per rank into this layout and its output back
(`RingLayout.to_balanced`, `from_balanced`), and reads off which keys each row sees (`tiles`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import cost_models as cm

from ..collectives import Comm, logged


def balanced_chunks(n: int) -> list[tuple[int, int]]:
    """Per rank of n, (the chunk it keeps, the chunk it receives) of the sequence in 2n chunks, rank r holding
    2r and 2r+1 before: a pair {c, 2n-1-c}, the same causal work on every rank. Ranks and pairs form cycles
    (two chunks per rank, each in a pair, each pair's chunks on two ranks); walking one, a rank keeps its
    chunk of the pair it was reached by, and the holder of that pair's other chunk takes its other pair."""
    keep: dict[int, int] = {}
    taken: set = set()
    for first in range(n):
        rank, chunk = first, 2 * first
        while rank not in keep and min(chunk, 2 * n - 1 - chunk) not in taken:
            keep[rank] = chunk
            taken.add(min(chunk, 2 * n - 1 - chunk))
            partner = 2 * n - 1 - chunk          # the pair's other chunk
            rank, chunk = partner // 2, partner ^ 1   # its holder keeps its own other chunk
    return [(keep[r], 2 * n - 1 - keep[r]) for r in range(n)]


def exchange(x: torch.Tensor, dest: int | None, src: int | None, comm: Comm, axis: int, phase: str,
             async_op: bool = False):
    """Send `x` to rank `dest` of the axis, receive its like from rank `src` (None: nothing that way) in one
    all_to_all_single with one non-zero split each way (the threaded group has no send/recv). Returns
    (the tensor received or None, the work)."""
    ax = comm.axes[axis]
    send = x.contiguous().reshape(-1) if dest is not None else x.new_empty(0)
    recv = x.new_empty(x.numel()) if src is not None else x.new_empty(0)
    send_sizes = [send.numel() if j == dest else 0 for j in range(ax.size)]
    recv_sizes = [recv.numel() if j == src else 0 for j in range(ax.size)]
    send = logged(send, comm, cm.SEND_RECV, axis, send.numel() * send.element_size(), phase)
    t0 = comm.start()
    work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=ax.group, async_op=async_op)
    comm.stop(axis, t0)
    return (recv.view(x.shape) if src is not None else None), work


class RingLayout:
    """Where this rank's query rows sit in the sequence: `segments`, (first local row, number of rows,
    chunk index) each, chunks of `chunk_len` rows; for a causal op, two chunks of 2n (balanced_chunks),
    else one segment of all the rows (chunk None: no mask)."""

    def __init__(self, n: int, rank: int, rows: int, causal: bool):
        self.n, self.rank, self.causal = n, rank, causal
        if not causal:
            self.segments, self.chunk_len = [(0, rows, None)], rows
            return
        m = self.chunk_len = rows // 2
        plan = balanced_chunks(n)
        self.kept, self.received = plan[rank]
        self.sent = self.kept ^ 1
        self.local = self.received // 2 == rank   # the middle rank of an odd n: it holds its pair already
        self.dest = next(r for r, (_, got) in enumerate(plan) if got == self.sent)
        self.src = self.received // 2
        lo, hi = sorted((self.kept, self.received))
        self.segments = [(0, m, lo), (m, m, hi)]

    def to_balanced(self, x: torch.Tensor, comm: Comm, axis: int, phase: str) -> torch.Tensor:
        """Rows in the model's layout (chunks 2r, 2r+1) -> this op's (kept and received, in sequence order)."""
        if not self.causal:
            return x
        if self.local:   # nothing to swap here, but the exchange is a collective the others run
            exchange(x.new_empty(0), None, None, comm, axis, phase)
            return x.clone()   # kept like every other rank's rows (the plan prices one new tensor each)
        m, own = self.chunk_len, 2 * self.rank
        rows = {c: x.narrow(-2, (c - own) * m, m) for c in (own, own + 1)}
        rows[self.received], _ = exchange(rows[self.sent], self.dest, self.src, comm, axis, phase)
        return torch.cat([rows[c] for _, _, c in self.segments], dim=-2)

    def from_balanced(self, x: torch.Tensor, comm: Comm, axis: int, phase: str) -> torch.Tensor:
        """The inverse of to_balanced: the received chunk's rows go back to their owner."""
        if not self.causal:
            return x
        if self.local:
            exchange(x.new_empty(0), None, None, comm, axis, phase)
            return flash_layout(x).copy_(x)
        m, own = self.chunk_len, 2 * self.rank
        rows = {c: x.narrow(-2, start, m) for start, _, c in self.segments}
        rows[self.sent], _ = exchange(rows[self.received], self.src, self.dest, comm, axis, phase)
        out = flash_layout(x)
        out.narrow(-2, 0, m).copy_(rows[own])
        out.narrow(-2, m, m).copy_(rows[own + 1])
        return out

    def tiles(self, holder: int, batch_heads: int, num_keys: int, tile_bytes: int, device):
        """(query rows, first key, end key, mask or None) of what this rank's rows see of rank `holder`'s
        `num_keys` keys, in tiles of rows (one at least) whose fp32 scores take at most `tile_bytes`."""
        for seg in self.segments:
            seen = self.visible(seg, holder, device)
            if seen is None:
                continue
            start, end, mask = seen
            keys = (num_keys if end is None else end) - start
            step = max(1, tile_bytes // max(1, 4 * batch_heads * keys))
            for r in range(0, seg[1], step):
                n = min(step, seg[1] - r)
                yield slice(seg[0] + r, seg[0] + r + n), start, end, None if mask is None else mask[r:r + n]

    def visible(self, segment, holder: int, device=None):
        """The keys of rank `holder`'s chunk that rows `segment` see: (first key, end key, mask or None),
        or None where a causal mask hides them all. A holder's keys are chunks 2h and 2h+1."""
        _, rows, chunk = segment
        if chunk is None:
            return 0, None, None
        m = self.chunk_len
        seen = [c for c in (2 * holder, 2 * holder + 1) if c <= chunk]
        if not seen:
            return None
        start, end = (seen[0] - 2 * holder) * m, (seen[-1] - 2 * holder + 1) * m
        mask = None
        if seen[-1] == chunk:   # the diagonal chunk: row i sees keys up to its own position
            mask = torch.ones(rows, end - start, dtype=torch.bool, device=device)
            mask = mask.tril(diagonal=(chunk - seen[0]) * m)
        return start, end, mask


def flash_layout(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty tensor shaped like `x` (batch, heads, rows, dim), laid out (batch, rows, heads, dim) as flash
    kernels return attention: the model's transpose(1, 2).contiguous() after it copies nothing, as after aten's."""
    dtype = dtype or x.dtype
    if x.dim() != 4:
        return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype=dtype).transpose(1, 2)
