"""Ring attention: the query's rows and the keys both split over one context axis.

Each rank holds a chunk of the sequence's queries, keys and values. K and V go round the axis, one chunk per
step (n steps, n-1 sends, each overlapping its step's compute), and the partial softmaxes merge by their
log-sum-exp:  lse' = logaddexp(lse, lse_blk);  out' = out * exp(lse - lse') + out_blk * exp(lse_blk - lse'),
so no rank holds K and V whole. Backward passes K and V round again with an fp32 accumulator of their
gradient, back at its owner after n sends; it needs only the output and lse kept from forward.

Causal balance: in 2n chunks, a rank holding chunks c and 2n-1-c does the same work as every other. The
model's tensors keep the contiguous layout; this op alone swaps one chunk of query rows per rank
(`balanced_chunks`; with an odd n the middle rank holds a pair already) and sends the output back.

Blocks are plain fp32 matmuls (the CPU flash kernel's lse has no gradient), skipping the blocks a causal mask
hides whole, in tiles of query rows whose scores stay under TILE_BYTES. A GPU would rather call its flash
kernels per block (private aten ops; not done). Dropout and masks never come here (sharding/rules.sdpa_rule).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

import cost_models as cm

from ...errors import InputShapeError
from ...sharding.op_spec import op_arg
from ...sharding.rules import ring_axes
from ..collectives import Comm, forward_phase, logged


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


def _exchange(x: torch.Tensor, dest: int | None, src: int | None, comm: Comm, axis: int, phase: str,
              async_op: bool = False):
    """Send `x` to rank `dest` of the axis, receive its like from rank `src` (None: nothing that way) in one
    all_to_all_single with one non-zero split each way (the threaded group has no send/recv)."""
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


class _Layout:
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
            _exchange(x.new_empty(0), None, None, comm, axis, phase)
            return x.clone()   # kept like every other rank's rows (the plan prices one new tensor each)
        m, own = self.chunk_len, 2 * self.rank
        rows = {c: x.narrow(-2, (c - own) * m, m) for c in (own, own + 1)}
        rows[self.received], _ = _exchange(rows[self.sent], self.dest, self.src, comm, axis, phase)
        return torch.cat([rows[c] for _, _, c in self.segments], dim=-2)

    def from_balanced(self, x: torch.Tensor, comm: Comm, axis: int, phase: str) -> torch.Tensor:
        """The inverse of to_balanced: the received chunk's rows go back to their owner."""
        if not self.causal:
            return x
        if self.local:
            _exchange(x.new_empty(0), None, None, comm, axis, phase)
            return _flash_layout(x).copy_(x)
        m, own = self.chunk_len, 2 * self.rank
        rows = {c: x.narrow(-2, start, m) for start, _, c in self.segments}
        rows[self.sent], _ = _exchange(rows[self.received], self.src, self.dest, comm, axis, phase)
        out = _flash_layout(x)
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


def _flash_layout(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty tensor shaped like `x` (batch, heads, rows, dim), laid out (batch, rows, heads, dim) as flash
    kernels return attention: the model's transpose(1, 2).contiguous() after it copies nothing, as after aten's."""
    dtype = dtype or x.dtype
    if x.dim() != 4:
        return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype=dtype).transpose(1, 2)


def _expand(k: torch.Tensor, q: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Key/value heads repeated to the query's (SDPA's enable_gqa: key head j serves query heads j*g..)."""
    if not gqa or k.dim() < 3 or k.shape[-3] == q.shape[-3]:
        return k
    return k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)


def _fold(dk: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The gradient of repeated heads summed back onto the heads `k` has."""
    if dk.shape == k.shape:
        return dk
    g = dk.shape[-3] // k.shape[-3]
    return dk.unflatten(-3, (k.shape[-3], g)).sum(-3)


def _scores(q, k, scale, mask):
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _kv_buffer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])   # one send a step, K and V together


def _split_kv(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return buf[:k.numel()].view(k.shape), buf[k.numel():].view(v.shape)


class _Ring:
    """One call's constants: the axis, this rank's place on it, the layout of its rows."""

    def __init__(self, comm: Comm, axis: int, layout: _Layout, scale: float, gqa: bool, tile_bytes: int):
        ax = comm.axes[axis]
        self.comm, self.axis, self.layout, self.scale, self.gqa = comm, axis, layout, scale, gqa
        self.tile_bytes = tile_bytes
        self.n, self.rank = ax.size, ax.coord
        self.next, self.prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n

    def blocks(self, buf: torch.Tensor, phase: str):
        """(holder of the chunk, the chunk's buffer) for each of the n steps; the next chunk's send is
        launched before the step's work and waited for after it."""
        for step in range(self.n):
            pending = None
            if step < self.n - 1:
                pending = _exchange(buf, self.next, self.prev, self.comm, self.axis, phase, async_op=True)
            yield (self.rank - step) % self.n, buf
            if pending is not None:
                recv, work = pending
                t0 = self.comm.start()   # blocked only while waiting (the launch is timed in _exchange)
                work.wait()
                self.comm.stop(self.axis, t0)
                buf = recv


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        phase = forward_phase()
        lay = ring.layout
        qb = lay.to_balanced(q, ring.comm, ring.axis, phase)
        out = qb.new_zeros(qb.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
        lse = torch.full(qb.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        batch_heads = math.prod(qb.shape[:-2])
        for holder, buf in ring.blocks(_kv_buffer(k, v), phase):
            kx, vx = (_expand(t, q, ring.gqa) for t in _split_kv(buf, k, v))
            for rows, start, end, mask in lay.tiles(holder, batch_heads, kx.shape[-2], ring.tile_bytes, q.device):
                s = _scores(qb[..., rows, :], kx[..., start:end, :], ring.scale, mask)
                lse_blk = torch.logsumexp(s, dim=-1)
                out_blk = torch.matmul(torch.exp(s - lse_blk.unsqueeze(-1)), vx[..., start:end, :].float())
                merged = torch.logaddexp(lse[..., rows], lse_blk)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                                     + out_blk * torch.exp(lse_blk - merged).unsqueeze(-1))
                lse[..., rows] = merged
        if lay.causal:   # kept in the op's row order, which backward works in; what it returns is new
            out = out.to(q.dtype)
            result = lay.from_balanced(out, ring.comm, ring.axis, phase)
        else:
            out = result = _flash_layout(out, q.dtype).copy_(out)
        ctx.save_for_backward(qb, k, v, out, lse)
        ctx.ring = ring
        return result

    @staticmethod
    def backward(ctx, grad_out):
        qb, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        lay = ring.layout
        do = lay.to_balanced(grad_out, ring.comm, ring.axis, "backward").float()
        delta = (do * out.float()).sum(-1)
        dq = torch.zeros(qb.shape, dtype=torch.float32, device=qb.device)
        batch_heads = math.prod(qb.shape[:-2])
        # the gradient of the chunk a rank holds travels with it, in fp32 (n additions)
        acc = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
        for holder, buf in ring.blocks(_kv_buffer(k, v), "backward"):
            kx, vx = (_expand(t, qb, ring.gqa).float() for t in _split_kv(buf, k, v))
            dk, dv = _split_kv(acc, k, v)
            for rows, start, end, mask in lay.tiles(holder, batch_heads, kx.shape[-2], ring.tile_bytes, qb.device):
                kk, vv, qq = kx[..., start:end, :], vx[..., start:end, :], qb[..., rows, :].float()
                p = torch.exp(_scores(qq, kk, ring.scale, mask) - lse[..., rows].unsqueeze(-1))
                ds = p * (torch.matmul(do[..., rows, :], vv.transpose(-2, -1)) - delta[..., rows].unsqueeze(-1))
                dq[..., rows, :] += torch.matmul(ds, kk) * ring.scale
                dk[..., start:end, :] += _fold(torch.matmul(ds.transpose(-2, -1), qq) * ring.scale, k)
                dv[..., start:end, :] += _fold(torch.matmul(p.transpose(-2, -1), do[..., rows, :]), v)
            acc, _ = _exchange(acc, ring.next, ring.prev, ring.comm, ring.axis, "backward")
        dk, dv = _split_kv(acc, k, v)
        dq = lay.from_balanced(dq.to(qb.dtype), ring.comm, ring.axis, "backward")
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


# fp32 scores of a tile of rows against a chunk of keys (~3x that at backward's peak): small beside a GPU's
# memory (8k rows against 8k keys on 32 heads would be 8 GiB), large enough to keep a tile's matmuls efficient
TILE_BYTES = 256 << 20


class RingAttention(nn.Module):
    """scaled_dot_product_attention(q, k, v) with the rows of q and of k, v split over mesh axis `axis`."""

    def __init__(self, comm: Comm, axis: int, causal: bool, scale: float | None, gqa: bool, label: str = "",
                 tile_bytes: int = TILE_BYTES):
        super().__init__()
        self.comm, self.axis, self.causal, self.scale, self.gqa, self.label = comm, axis, causal, scale, gqa, label
        self.tile_bytes = tile_bytes

    def forward(self, q, k, v):
        ax = self.comm.axes[self.axis]
        if self.causal and (q.shape[-2] != k.shape[-2] or q.shape[-2] % 2):
            # the plan checked the example's length; a call's may differ (a dynamic sequence dim)
            raise InputShapeError(
                f"{self.label}: causal ring attention over mesh axis {self.axis} cuts the sequence into 2 x "
                f"{ax.size} chunks, so its length must divide by {2 * ax.size} and its queries and keys be "
                f"one sequence; this rank got {q.shape[-2]} query and {k.shape[-2]} key positions. Pad the "
                f"batch to a multiple of {2 * ax.size} positions.")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        layout = _Layout(ax.size, ax.coord, q.shape[-2], self.causal)
        return _RingAttentionFn.apply(q, k, v, _Ring(self.comm, self.axis, layout, scale, self.gqa, self.tile_bytes))

    def extra_repr(self) -> str:
        return f"{self.label}, axis={self.axis}, causal={self.causal}"


def ring_attention(node: fx.Node, strategy, comm: Comm, sizes) -> RingAttention:
    """The module that runs attention `node` as a ring over the one axis sharding/rules.ring_axes names."""
    (axis,) = ring_axes(node, strategy, sizes)
    return RingAttention(comm, axis, bool(op_arg(node, 5, "is_causal", False)), op_arg(node, 6, "scale", None),
                         bool(op_arg(node, 7, "enable_gqa", False)), node.name)
