"""Collectives as autograd functions whose backward is the conjugate.

`transform` is the one-axis layout change on plain tensors (every collective
autopar issues goes through it, so they are all visible in one place and all
counted). `Redistribute` wraps one Step: forward turns step.src into step.dst,
backward turns the gradient's layout step.grad_dst into step.grad_src --
all-gather <-> reduce-scatter, identity <-> all-reduce, chunk <-> all-gather,
all-to-all <-> all-to-all.
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._compat import backward_id, register_ordered_effect
from ..sharding.placement import chunk_span
from ..sharding.placement import shard_dim as _cached_shard_dim
from ..sharding.redistribute import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, CHUNK, NONE, REDUCE_SCATTER, ZERO, Step,
                                     transition)
from .rng import RandomStreams


@dataclass
class AxisGroup:
    """One mesh axis as this rank sees it."""
    group: object   # the ProcessGroup of this rank's slice along the axis
    size: int
    coord: int      # this rank's index along the axis


def rank_chunk(axes: tuple, coords, axis_sizes) -> tuple[int, int]:
    """(which chunk this rank holds, how many chunks) of a dim that mesh `axes` split (in mesh order), `coords`
    this rank's place on each axis. The plan records the axes (sharding/local_ops.LocalOp); the chunks nest in
    mesh order, row-major over the coordinates, as placement.chunk_index counts them."""
    index, pieces = 0, 1
    for a in axes:
        index, pieces = index * axis_sizes[a] + coords[a], pieces * axis_sizes[a]
    return index, pieces


_log_keys = itertools.count()
# key -> CommLog, for the logging op a compiled graph runs (an op's arguments are tensors and numbers, not
# Python objects); weak, so a log nothing else holds goes away
_LOGS: "weakref.WeakValueDictionary[int, CommLog]" = weakref.WeakValueDictionary()


@dataclass(eq=False)
class CommLog:
    """Every collective this rank launched: (kind, axis, whole-tensor bytes, phase)."""
    records: list = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_log_keys))

    def __post_init__(self):
        _LOGS[self.key] = self

    def add(self, kind: str, axis: int, full_bytes: int, phase: str):
        self.records.append((kind, axis, full_bytes, phase))


@torch.library.custom_op("autopar::logged_send", mutates_args=())
def _logged_send(x: torch.Tensor, log: int, kind: str, axis: int, nbytes: int, phase: str) -> torch.Tensor:
    """A copy of `x`, the tensor a collective sends next, with the launch appended to CommLog `log`.

    This is how a compiled graph logs: torch.compile cannot put a Python list's append inside an
    autograd function's graph (it breaks the graph there), but it runs this op where the graph has it,
    each time, before the collective that sends its result."""
    _LOGS[log].add(kind, axis, nbytes, phase)
    return x.clone()


@_logged_send.register_fake
def _(x, log, kind, axis, nbytes, phase):
    return torch.empty_like(x)


# its append is a side effect: without one registered, the compiler would take it for a pure op (no argument
# is mutated) and merge two launches logged alike (two collectives sending one tensor) into one record
register_ordered_effect(_logged_send)


@dataclass
class Comm:
    axes: list          # AxisGroup per mesh axis
    log: CommLog | None = None
    # axis -> seconds this rank spent blocked in collectives (calls and waits); None: not timed.
    # autopar.audit sets it to measure the exposed communication the plan predicts.
    clock: dict | None = None
    # the reduction engine's collectives as torch's functional collectives (reduction/engine.launch), which
    # torch.compile can trace into its graph; False: torch.distributed's asynchronous calls
    functional: bool = False
    # the streams this rank's random ops draw from (rng.py): parallelize seeds them alike on every rank
    random_streams: RandomStreams = field(default_factory=lambda: RandomStreams(0))

    def start(self):
        """A blocking call or wait begins: its start time when the clock runs, else None."""
        return time.perf_counter() if self.clock is not None else None

    def stop(self, axis: int, started) -> None:
        if started is not None:
            self.clock[axis] = self.clock.get(axis, 0.0) + time.perf_counter() - started


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# uncached here: torch.compile traces transform, and warns at each functools.cache it meets
shard_dim = _cached_shard_dim.__wrapped__


def forward_phase() -> str:
    """What a forward collective runs as: "recompute" while backward runs (a checkpointed block's forward run
    again to remake what it did not keep; runtime/lowering/recompute.py), "forward" otherwise. Read from
    autograd's engine, not from a flag the recompute would have to set and reset. A compiled graph's
    collectives are traced, and logged, as forward's."""
    if torch.compiler.is_dynamo_compiling():
        return "forward"
    return "recompute" if backward_id() != -1 else "forward"


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def transform(x: torch.Tensor, src: str, dst: str, axis: int, comm: Comm, phase: str,
              whole: int | None = None) -> torch.Tensor:
    """Turn the local tensor of layout `src` on `axis` into the local tensor of layout `dst`.

    `whole`: the length of the split dim once gathered, for a split that does not divide (the
    pieces are torch.chunk's, placement.chunk_span); None: n times this rank's piece. A split that
    does not divide is padded to n equal pieces for the collective and cut back after it.
    """
    kind = transition(src, dst)
    ax = comm.axes[axis]
    n, g = ax.size, ax.group
    if kind == NONE:
        return x
    if kind == CHUNK:
        d = shard_dim(dst)
        start, length = chunk_span(x.shape[d], n, ax.coord)
        return x.narrow(d, start, length).contiguous()
    if kind == ZERO:  # R -> P: one rank keeps the value so the pending sum counts it once
        return x if ax.coord == 0 else torch.zeros_like(x)
    if kind == ALL_REDUCE:
        # reduced in a copy (x may be saved or read elsewhere); one copy, contiguous as gloo and NCCL need
        y = logged(x.clone(memory_format=torch.contiguous_format), comm, ALL_REDUCE, axis, _bytes(x), phase)
        t0 = comm.start()
        dist.all_reduce(y, group=g)
        comm.stop(axis, t0)
        return y
    if kind == ALL_GATHER:
        d = shard_dim(src)
        size = n * x.shape[d] if whole is None else whole
        if d != 0 and size == n * x.shape[d]:
            return _all_gather_inner(x, d, comm, axis, phase)
        return _all_gather_padded(x, d, size, comm, axis, phase)
    if kind == REDUCE_SCATTER:
        d = shard_dim(dst)
        if d != 0 and x.shape[d] % n == 0:
            return _reduce_scatter_inner(x, d, comm, axis, phase)
        return _reduce_scatter_padded(x, d, comm, axis, phase)
    if kind == ALL_TO_ALL:
        d_in, d_out = shard_dim(src), shard_dim(dst)
        send = torch.stack(x.chunk(n, dim=d_out)).contiguous()   # piece j goes to rank j
        send = logged(send, comm, ALL_TO_ALL, axis, _bytes(send) * n, phase)
        recv = torch.empty_like(send)
        t0 = comm.start()
        dist.all_to_all_single(recv, send, group=g)
        comm.stop(axis, t0)
        return torch.cat(recv.unbind(0), dim=d_in).contiguous()  # pieces from ranks 0..n-1 along d_in
    raise AssertionError(kind)


def _all_gather_padded(x: torch.Tensor, d: int, size: int, comm: Comm, axis: int, phase: str) -> torch.Tensor:
    """`x` split along dim d (torch.chunk's pieces of a dim of length `size`) gathered whole: the split dim
    moved to the front and padded to equal pieces, gathered, the padding cut off and the dim moved back."""
    ax = comm.axes[axis]
    n = ax.size
    piece = -(-size // n)
    xs = pad_to(x.movedim(d, 0), piece).contiguous()
    xs = logged(xs, comm, ALL_GATHER, axis, n * _bytes(xs), phase)
    out = xs.new_empty((n * piece,) + tuple(xs.shape[1:]))
    t0 = comm.start()
    all_gather_tensor(out, xs, group=ax.group)
    comm.stop(axis, t0)
    out = out[:size]   # the padding off (a prefix: still contiguous)
    return out if d == 0 else out.movedim(0, d).contiguous()


def _reduce_scatter_padded(x: torch.Tensor, d: int, comm: Comm, axis: int, phase: str) -> torch.Tensor:
    """`x` summed over `axis` and split along dim d as torch.chunk splits it: the dim moved to the front
    and padded to n equal pieces, reduce-scattered, this rank's piece cut to its length and moved back."""
    ax = comm.axes[axis]
    n = ax.size
    size = x.shape[d]
    piece = -(-size // n)
    xs = pad_to(x.movedim(d, 0), n * piece).contiguous()
    xs = logged(xs, comm, REDUCE_SCATTER, axis, _bytes(xs), phase)
    out = xs.new_empty((piece,) + tuple(xs.shape[1:]))
    t0 = comm.start()
    reduce_scatter_tensor(out, xs, group=ax.group)
    comm.stop(axis, t0)
    out = out[:chunk_span(size, n, ax.coord)[1]]
    return out if d == 0 else out.movedim(0, d).contiguous()


def _all_gather_inner(x: torch.Tensor, d: int, comm: Comm, axis: int, phase: str) -> torch.Tensor:
    """`x` split evenly along dim d > 0, gathered whole. The collective stacks the ranks' pieces along a new
    leading dim, so each piece is sent as it is (no copy when contiguous), and one copy puts them side by
    side along d, moving contiguous runs of the dims from d on. Moving d to the front instead costs a
    transposing copy on each side (for the vocabulary dim of logits, runs of one element)."""
    ax = comm.axes[axis]
    n = ax.size
    xs = logged(x.contiguous(), comm, ALL_GATHER, axis, n * _bytes(x), phase)
    out = xs.new_empty((n * xs.shape[0],) + tuple(xs.shape[1:]))
    t0 = comm.start()
    all_gather_tensor(out, xs, group=ax.group)
    comm.stop(axis, t0)
    shape = list(xs.shape)
    shape[d] *= n
    return out.view((n,) + tuple(xs.shape)).movedim(0, d).reshape(shape)


def _reduce_scatter_inner(x: torch.Tensor, d: int, comm: Comm, axis: int, phase: str) -> torch.Tensor:
    """`x` summed over `axis` and split evenly along dim d > 0: one copy lays the ranks' pieces out one
    after another (contiguous runs of the dims from d on), and the collective's output is this rank's
    piece as it is (see _all_gather_inner)."""
    ax = comm.axes[axis]
    n = ax.size
    shape = tuple(x.shape)
    piece = shape[d] // n
    # rank r's piece is rows r*shape[0] .. (r+1)*shape[0] - 1 of a tensor split along dim 0, as the
    # collective cuts its input
    xs = x.reshape(shape[:d] + (n, piece) + shape[d + 1:]).movedim(d, 0).reshape((n * shape[0],) + shape[1:d]
                                                                                 + (piece,) + shape[d + 1:])
    xs = logged(xs, comm, REDUCE_SCATTER, axis, _bytes(xs), phase)
    out = xs.new_empty(shape[:d] + (piece,) + shape[d + 1:])
    t0 = comm.start()
    reduce_scatter_tensor(out, xs, group=ax.group)
    comm.stop(axis, t0)
    return out


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` with zeros appended along dim 0 up to `length` rows (itself when it has them)."""
    if x.shape[0] == length:
        return x
    return torch.cat([x, x.new_zeros((length - x.shape[0],) + tuple(x.shape[1:]))])


def log_collective(comm: Comm, kind, axis, nbytes, phase):
    """A launch logged (when comm logs), by code that runs eagerly: the reduction engine and clipping.
    Inside a graph torch.compile may trace, use `logged`."""
    if comm.log is not None:
        comm.log.add(kind, axis, nbytes, phase)


def logged(x: torch.Tensor, comm: Comm, kind, axis, nbytes, phase) -> torch.Tensor:
    """`x`, which a collective sends next, with the launch logged (when comm logs): eagerly an append to the
    log; while torch.compile traces, the logging op above, which the compiled graph runs each step."""
    if comm.log is None:
        return x
    if torch.compiler.is_dynamo_compiling():
        return torch.ops.autopar.logged_send(x, comm.log.key, kind, axis, nbytes, phase)
    comm.log.add(kind, axis, nbytes, phase)
    return x


class Redistribute(torch.autograd.Function):
    """One Step; `whole`: the length of the dim it splits or gathers, where the split does not divide."""
    @staticmethod
    def forward(ctx, x, step: Step, comm: Comm, whole=None):
        ctx.step, ctx.comm, ctx.whole = step, comm, whole
        return transform(x, step.src, step.dst, step.axis, comm, forward_phase(), whole)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.step
        return transform(grad, s.grad_dst, s.grad_src, s.axis, ctx.comm, "backward", ctx.whole), None, None, None


class CastAndRedistribute(torch.autograd.Function):
    """A weight stored in the master dtype, as an op uses it: cast to the compute dtype, then the steps
    (so an FSDP all-gather moves compute-dtype bytes). Backward casts the gradient to the reduce dtype
    before the steps' reductions and returns it in the master dtype: one function, because autograd
    would cast a gradient leaving a step back to that step's input dtype before the next reduced it."""
    @staticmethod
    def forward(ctx, master, steps, wholes, comm: Comm, compute_dtype, reduce_dtype):
        ctx.steps, ctx.wholes, ctx.comm, ctx.reduce_dtype, ctx.master_dtype = steps, wholes, comm, reduce_dtype, master.dtype
        x = master.to(compute_dtype)
        for s, whole in zip(steps, wholes):
            x = transform(x, s.src, s.dst, s.axis, comm, forward_phase(), whole)
        return x

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(ctx.reduce_dtype)
        for s, whole in zip(reversed(ctx.steps), reversed(ctx.wholes)):
            g = transform(g, s.grad_dst, s.grad_src, s.axis, ctx.comm, "backward", whole)
        return g.to(ctx.master_dtype), None, None, None, None, None


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
