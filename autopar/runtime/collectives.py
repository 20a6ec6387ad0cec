"""Collectives as autograd functions whose backward is the conjugate.

`transform` is the one-axis layout change on plain tensors (every collective
autopar issues goes through it, so they are all visible in one place and all
counted). `Redistribute` wraps one Step: forward turns step.src into step.dst,
backward turns the gradient's layout step.grad_dst into step.grad_src --
all-gather <-> reduce-scatter, identity <-> all-reduce, chunk <-> all-gather,
all-to-all <-> all-to-all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..sharding.placement import shard_dim
from ..sharding.redistribute import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, CHUNK, NONE, REDUCE_SCATTER, ZERO, Step,
                                     transition)


@dataclass
class AxisGroup:
    """One mesh axis as this rank sees it."""
    group: object   # the ProcessGroup of this rank's slice along the axis
    size: int
    coord: int      # this rank's index along the axis


@dataclass
class CommLog:
    """Every collective this rank launched: (kind, axis, whole-tensor bytes, phase)."""
    records: list = field(default_factory=list)

    def add(self, kind: str, axis: int, full_bytes: int, phase: str):
        self.records.append((kind, axis, full_bytes, phase))


@dataclass
class Comm:
    axes: list          # AxisGroup per mesh axis
    log: CommLog | None = None
    # what forward collectives are logged as: "recompute" while backward reruns a checkpointed block
    forward_phase: str = "forward"


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def transform(x: torch.Tensor, src: str, dst: str, axis: int, comm: Comm, phase: str) -> torch.Tensor:
    """Turn the local tensor of layout `src` on `axis` into the local tensor of layout `dst`."""
    kind = transition(src, dst)
    ax = comm.axes[axis]
    n, g = ax.size, ax.group
    if kind == NONE:
        return x
    if kind == CHUNK:
        return x.chunk(n, dim=shard_dim(dst))[ax.coord].contiguous()
    if kind == ZERO:  # R -> P: one rank keeps the value so the pending sum counts it once
        return x if ax.coord == 0 else torch.zeros_like(x)
    if kind == ALL_REDUCE:
        y = x.contiguous().clone()
        _log(comm, ALL_REDUCE, axis, _bytes(y), phase)
        dist.all_reduce(y, group=g)
        return y
    if kind == ALL_GATHER:
        d = shard_dim(src)
        xs = x.movedim(d, 0).contiguous()
        out = xs.new_empty((n * xs.shape[0],) + tuple(xs.shape[1:]))
        _log(comm, ALL_GATHER, axis, _bytes(out), phase)
        _all_gather(out, xs, group=g)
        return out if d == 0 else out.movedim(0, d).contiguous()
    if kind == REDUCE_SCATTER:
        d = shard_dim(dst)
        xs = x.movedim(d, 0).contiguous()
        out = xs.new_empty((xs.shape[0] // n,) + tuple(xs.shape[1:]))
        _log(comm, REDUCE_SCATTER, axis, _bytes(xs), phase)
        _reduce_scatter(out, xs, group=g)
        return out if d == 0 else out.movedim(0, d).contiguous()
    if kind == ALL_TO_ALL:
        d_in, d_out = shard_dim(src), shard_dim(dst)
        send = torch.stack(x.chunk(n, dim=d_out)).contiguous()   # piece j goes to rank j
        recv = torch.empty_like(send)
        _log(comm, ALL_TO_ALL, axis, _bytes(send) * n, phase)
        dist.all_to_all_single(recv, send, group=g)
        return torch.cat(recv.unbind(0), dim=d_in).contiguous()  # pieces from ranks 0..n-1 along d_in
    raise AssertionError(kind)


def _log(comm: Comm, kind, axis, nbytes, phase):
    if comm.log is not None:
        comm.log.add(kind, axis, nbytes, phase)


class Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step: Step, comm: Comm):
        ctx.step, ctx.comm = step, comm
        return transform(x, step.src, step.dst, step.axis, comm, comm.forward_phase)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.step
        return transform(grad, s.grad_dst, s.grad_src, s.axis, ctx.comm, "backward"), None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by `scale`.

    Outputs split over the batch axes give each rank the mean of its own
    shard; scaling their gradient by 1/(number of shards) makes every later
    sum of gradients the gradient of the global mean.
    """
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ScaleGrad.apply(x, scale)
