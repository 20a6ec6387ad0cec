"""Ring attention: the query's rows and the keys both split over one context axis.

Each rank holds a chunk of the sequence's queries, keys and values. K and V go round the axis, one chunk per
step (n steps, n-1 sends, each overlapping its step's compute), and the partial softmaxes merge by their
log-sum-exp:  lse' = logaddexp(lse, lse_blk);  out' = out * exp(lse - lse') + out_blk * exp(lse_blk - lse'),
so no rank holds K and V whole. Backward passes K and V round again with an fp32 accumulator of their
gradient, back at its owner after n sends; it needs only the output and lse kept from forward.

Causal balance: in 2n chunks, a rank holding chunks c and 2n-1-c does the same work as every other. The
model's tensors keep the contiguous layout; this op alone swaps one chunk of query rows per rank
(`ring_layout.balanced_chunks`; with an odd n the middle rank holds a pair already) and sends the output back.

Blocks are plain fp32 matmuls (the CPU flash kernel's lse has no gradient), skipping the blocks a causal mask
hides whole, in tiles of query rows whose scores stay under TILE_BYTES. A GPU would rather call its flash
kernels per block (private aten ops; not done). A boolean mask comes split with the query's rows, its keys
whole: each block reads its holder's columns. Dropout never comes here (sharding/rules.sdpa_rule).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ...errors import InputShapeError
from ...sharding.local_ops import Ring
from ..collectives import Comm, forward_phase
from .ring_layout import RingLayout, exchange, flash_layout


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


def _tile_mask(causal, attn_mask, rows: slice, first_key: int, end_key: int):
    """The causal tile mask and the caller's boolean mask (rows split like q, keys whole; a dim of size 1
    broadcasts), its rows and global keys [first_key, end_key) read, combined; None where neither is."""
    if attn_mask is None:
        return causal
    m = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., rows, :]
    m = m if m.shape[-1] == 1 else m[..., first_key:end_key]
    return m if causal is None else m & causal


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with 0 for rows that see no key (-inf), so exp(s - lse) is 0 there, not nan: SDPA returns 0 and
    no gradient for such a row, and a block may hide all of a row's keys that a later block shows."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _kv_buffer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])   # one send a step, K and V together


def _split_kv(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return buf[:k.numel()].view(k.shape), buf[k.numel():].view(v.shape)


class _Ring:
    """One call's constants: the axis, this rank's place on it, the layout of its rows."""

    def __init__(self, comm: Comm, axis: int, layout: RingLayout, scale: float, gqa: bool, tile_bytes: int):
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
                pending = exchange(buf, self.next, self.prev, self.comm, self.axis, phase, async_op=True)
            yield (self.rank - step) % self.n, buf
            if pending is not None:
                recv, work = pending
                t0 = self.comm.start()   # blocked only while waiting (the launch is timed in exchange)
                work.wait()
                self.comm.stop(self.axis, t0)
                buf = recv


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, ring: _Ring):
        phase = forward_phase()
        lay = ring.layout
        qb = lay.to_balanced(q, ring.comm, ring.axis, phase)
        out = qb.new_zeros(qb.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
        lse = torch.full(qb.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        batch_heads = math.prod(qb.shape[:-2])
        for holder, buf in ring.blocks(_kv_buffer(k, v), phase):
            kx, vx = (_expand(t, q, ring.gqa) for t in _split_kv(buf, k, v))
            first = holder * k.shape[-2]   # the chunk's first key in the sequence (a mask's column)
            for rows, start, end, mask in lay.tiles(holder, batch_heads, kx.shape[-2], ring.tile_bytes, q.device):
                end = kx.shape[-2] if end is None else end
                mask = _tile_mask(mask, attn_mask, rows, first + start, first + end)
                s = _scores(qb[..., rows, :], kx[..., start:end, :], ring.scale, mask)
                lse_blk = torch.logsumexp(s, dim=-1)
                out_blk = torch.matmul(torch.exp(s - _finite(lse_blk).unsqueeze(-1)), vx[..., start:end, :].float())
                merged = torch.logaddexp(lse[..., rows], lse_blk)
                safe = _finite(merged)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - safe).unsqueeze(-1)
                                     + out_blk * torch.exp(lse_blk - safe).unsqueeze(-1))
                lse[..., rows] = merged
        if lay.causal:   # kept in the op's row order, which backward works in; what it returns is new
            out = out.to(q.dtype)
            result = lay.from_balanced(out, ring.comm, ring.axis, phase)
        else:
            out = result = flash_layout(out, q.dtype).copy_(out)
        ctx.save_for_backward(qb, k, v, out, _finite(lse), attn_mask)
        ctx.ring = ring
        return result

    @staticmethod
    def backward(ctx, grad_out):
        qb, k, v, out, lse, attn_mask = ctx.saved_tensors
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
            first = holder * k.shape[-2]
            for rows, start, end, mask in lay.tiles(holder, batch_heads, kx.shape[-2], ring.tile_bytes, qb.device):
                end = kx.shape[-2] if end is None else end
                mask = _tile_mask(mask, attn_mask, rows, first + start, first + end)
                kk, vv, qq = kx[..., start:end, :], vx[..., start:end, :], qb[..., rows, :].float()
                p = torch.exp(_scores(qq, kk, ring.scale, mask) - lse[..., rows].unsqueeze(-1))
                ds = p * (torch.matmul(do[..., rows, :], vv.transpose(-2, -1)) - delta[..., rows].unsqueeze(-1))
                dq[..., rows, :] += torch.matmul(ds, kk) * ring.scale
                dk[..., start:end, :] += _fold(torch.matmul(ds.transpose(-2, -1), qq) * ring.scale, k)
                dv[..., start:end, :] += _fold(torch.matmul(p.transpose(-2, -1), do[..., rows, :]), v)
            acc, _ = exchange(acc, ring.next, ring.prev, ring.comm, ring.axis, "backward")
        dk, dv = _split_kv(acc, k, v)
        dq = lay.from_balanced(dq.to(qb.dtype), ring.comm, ring.axis, "backward")
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


# fp32 scores of a tile of rows against a chunk of keys (~3x that at backward's peak): small beside a GPU's
# memory (8k rows against 8k keys on 32 heads would be 8 GiB), large enough to keep a tile's matmuls efficient
TILE_BYTES = 256 << 20


class RingAttention(nn.Module):
    """scaled_dot_product_attention(q, k, v) with the rows of q and of k, v split over mesh axis `axis`."""

    def __init__(self, comm: Comm, axis: int, causal: bool, scale: float | None, gqa: bool, label: str = "",
                 tile_bytes: int = TILE_BYTES, repeats: int = 1):
        super().__init__()
        self.comm, self.axis, self.causal, self.scale, self.gqa, self.label = comm, axis, causal, scale, gqa, label
        self.tile_bytes, self.repeats = tile_bytes, repeats

    def forward(self, q, k, v, attn_mask=None):
        ax = self.comm.axes[self.axis]
        if self.causal and (q.shape[-2] != k.shape[-2] or q.shape[-2] % 2):
            # the plan checked the example's length; a call's may differ (a dynamic sequence dim)
            raise InputShapeError(
                f"{self.label}: causal ring attention over mesh axis {self.axis} cuts the sequence into 2 x "
                f"{ax.size} chunks, so its length must divide by {2 * ax.size} and its queries and keys be "
                f"one sequence; this rank got {q.shape[-2]} query and {k.shape[-2]} key positions. Pad the "
                f"batch to a multiple of {2 * ax.size} positions.")
        if attn_mask is not None and (self.causal or attn_mask.shape[-2] not in (1, q.shape[-2])
                                      or attn_mask.shape[-1] not in (1, ax.size * k.shape[-2])):
            raise InputShapeError(
                f"{self.label}: ring attention over mesh axis {self.axis} takes a mask of this rank's "
                f"{q.shape[-2]} query rows by all {ax.size * k.shape[-2]} keys, and none with is_causal (as "
                f"SDPA); it got {tuple(attn_mask.shape)}")
        if self.repeats > 1:
            # k and v hold each head `repeats` times (GQA's repeat_kv before the op): one copy of each goes
            # round, and all of a group's gradient flows into it (repeat_kv's backward sums the copies anyway)
            k, v = (t.unflatten(-3, (t.shape[-3] // self.repeats, self.repeats)).select(-3, 0).contiguous()
                    for t in (k, v))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        layout = RingLayout(ax.size, ax.coord, q.shape[-2], self.causal)
        ring = _Ring(self.comm, self.axis, layout, scale, self.gqa or self.repeats > 1, self.tile_bytes)
        return _RingAttentionFn.apply(q, k, v, attn_mask, ring)

    def extra_repr(self) -> str:
        return f"{self.label}, axis={self.axis}, causal={self.causal}, repeats={self.repeats}"


def ring_attention(ring: Ring, comm: Comm, label: str) -> RingAttention:
    """The module that runs an attention as the plan's record `ring` says (sharding/local_ops.Ring: the one axis
    sharding/rules.ring_axes names, its keys and values repeated `ring.repeats` times per head)."""
    return RingAttention(comm, ring.axis, ring.causal, ring.scale, ring.gqa, label, repeats=ring.repeats)
