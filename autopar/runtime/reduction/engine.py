"""The reduction engine: gradient reductions, and the weight gathers beside them, launched while backward runs.

Three users, one cycle:
- grad_buckets.py  DDP: gradients of replicated weights all-reduced in flat buckets;
- layer_groups.py  FSDP: a layer's weights all-gathered together, its gradients reduce-scattered together;
- zero_buckets.py  ZeRO-1/2: gradients reduce-scattered into the optimizer's slices.
Each says what goes into a send buffer and where the result goes. This module does the rest, the same way
for all three:

    arrive   a gradient comes in: the user copies it into its bucket's send buffer, and the first
             arrival of a backward queues the user's finish at that backward's end (BackwardEnd)
    launch   a bucket all of whose gradients have come is issued asynchronously (launch()), in index
             order (InOrder: every rank issues the same collectives in the same order, whatever order
             its gradients came in), with at most a few outstanding where each holds a send buffer
             (InFlight)
    finish   when backward ends: what has not launched launches, everything is waited on, and each
             gradient is set or added (accumulate_grad)

How a collective is issued is decided in one place, launch(), by `Comm.functional`:
- False (the default): torch.distributed's asynchronous calls, a Work to wait on. The collective runs
  while backward goes on computing, with no compiler involved.
- True: torch's functional collectives (_compat.functional_collectives), an op that returns the result
  tensor and a wait. torch.compile traces these into its graph, where inductor may bucket and reorder them
  (SimpleFSDP's way), where a hook or a Work would break the graph. In eager mode they run asynchronously
  too, so overlap is kept either way.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..._compat import at_backward_end, backward_id, functional_collectives
from ...sharding.placement import chunk_span
from ...sharding.redistribute import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from ..collectives import Comm, all_gather_tensor, log_collective, pad_to, reduce_scatter_tensor


class Launched:
    """A collective on its way. wait() blocks until its result is ready and returns it (the result of a
    functional collective is another tensor than the one sent, so read it from here)."""

    def __init__(self, result: torch.Tensor, work, comm: Comm, axis: int):
        self.result, self.work, self.comm, self.axis = result, work, comm, axis
        self._waited = False

    def wait(self) -> torch.Tensor:
        if not self._waited:
            t0 = self.comm.start()
            if self.work is not None:
                self.work.wait()
                self.work = None   # drops the Work, and with it the send buffer it holds
            else:
                self.result = functional_collectives()[3](self.result)
            self.comm.stop(self.axis, t0)
            self._waited = True
        return self.result


def launch(kind: str, send: torch.Tensor, comm: Comm, axis: int, phase: str) -> Launched:
    """Issue collective `kind` (ALL_REDUCE, REDUCE_SCATTER or ALL_GATHER, flat along dim 0) of the
    contiguous `send` on mesh axis `axis`, asynchronously, logged as moving the whole tensor's bytes."""
    ax = comm.axes[axis]
    n = ax.size
    whole = send.numel() * send.element_size() * (n if kind == ALL_GATHER else 1)
    log_collective(comm, kind, axis, whole, phase)
    t0 = comm.start()   # a launch counts too: some backends (the threaded one) block in it
    if comm.functional:
        all_reduce, reduce_scatter, all_gather, _ = functional_collectives()
        issue = {ALL_REDUCE: all_reduce, REDUCE_SCATTER: reduce_scatter, ALL_GATHER: all_gather}[kind]
        launched = Launched(issue(send, ax.group), None, comm, axis)
    elif kind == ALL_REDUCE:   # in place
        launched = Launched(send, dist.all_reduce(send, group=ax.group, async_op=True), comm, axis)
    else:
        out = send.new_empty(send.numel() // n if kind == REDUCE_SCATTER else send.numel() * n)
        call = reduce_scatter_tensor if kind == REDUCE_SCATTER else all_gather_tensor
        launched = Launched(out, call(out, send, group=ax.group, async_op=True), comm, axis)
    comm.stop(axis, t0)
    return launched


def accumulate_grad(holder: torch.Tensor, grad: torch.Tensor) -> None:
    """`holder.grad` set to `grad`, or `grad` added to the one there (gradients accumulate over backwards
    until zero_grad, as autograd's own do)."""
    if holder.grad is None:
        holder.grad = grad
    else:
        holder.grad.add_(grad)


class BackwardEnd:
    """Runs `finish()` once when the backward now running ends: an autograd-engine callback, as DDP's
    reducer and FSDP2 wait for their reductions, so the gradients are whole when loss.backward() returns.

    torch drops the callbacks of a backward that raised; `drop()` then forgets what that one half did,
    before the next backward queues its own."""

    def __init__(self, finish, drop):
        self._finish, self._drop = finish, drop
        self._queued = None   # the backward_id whose end runs finish

    def is_queued(self) -> bool:
        """Whether finish is queued at the end of the backward now running."""
        return self._queued == backward_id()

    def queue(self) -> None:
        if self.is_queued():
            return
        if self._queued is not None:   # queued in a backward that raised: torch never ran it
            self._queued = None
            self._drop()
        self._queued = backward_id()
        at_backward_end(self._run)

    def _run(self) -> None:
        self._queued = None
        self._finish()


class InOrder:
    """Buckets launched in index order as each becomes ready (`ready(bucket)`), by `start(bucket)`."""

    def __init__(self, buckets: list, ready, start):
        self.buckets, self._ready, self._start = buckets, ready, start
        self.next = 0   # the first bucket not yet launched in this backward

    def advance(self) -> None:
        while self.next < len(self.buckets) and self._ready(self.buckets[self.next]):
            self._start(self.buckets[self.next])
            self.next += 1

    def rest(self) -> None:
        """Launch every bucket not launched yet (the end of backward), and start over."""
        for b in self.buckets[self.next:]:
            self._start(b)
        self.next = 0


class InFlight:
    """Launched reductions, oldest first, at most `limit` at a time: each holds its send buffer (a layer's
    whole gradients) until it completes, so launching one more first retires the oldest (`retire(entry)`:
    wait for it, and whatever its user does then). FSDP2 frees a reduce-scatter's input before it issues the
    next layer's in the same way: backward holds one layer's gradients in flight beside the layer it is
    making, not every layer's until it ends (which made a 16-layer model's step peak 1.4x the prediction).
    The reduction still runs while the next layer's backward computes."""

    def __init__(self, retire, limit: int = 1):
        self._retire, self.limit = retire, limit
        self.entries: list = []

    def make_room(self) -> None:
        while len(self.entries) >= self.limit:
            self._retire(self.entries.pop(0))

    def add(self, entry) -> None:
        self.entries.append(entry)

    def discard(self, entry) -> None:
        if entry in self.entries:
            self.entries.remove(entry)

    def drain(self) -> None:
        while self.entries:
            self._retire(self.entries.pop(0))


# ------------------------------------------------------------------ flat layouts of several tensors

def all_gather_flat(xs: list, dims: list, wholes: list, comm: Comm, axis: int, phase: str,
                    async_op: bool = False):
    """Several tensors split on `axis` (along dims[i], whole length wholes[i]) gathered whole in one
    all-gather: each rank's pieces padded to ceil(whole / n) and concatenated, as FSDP2 lays out a layer.
    Tensors of several dtypes (a layer's float8 weights beside its norms') travel as their bytes, as FSDP2
    gathers them. Returns the whole tensors, or with async_op (launched, finish): finish() waits and returns
    them."""
    n = comm.axes[axis].size
    moved = [pad_to(x.movedim(d, 0), -(-w // n)).contiguous() for x, d, w in zip(xs, dims, wholes)]
    mixed = len({t.dtype for t in moved}) > 1
    flat = [t.reshape(-1).view(torch.uint8) if mixed else t.reshape(-1) for t in moved]
    send = torch.cat(flat)
    del flat
    launched = launch(ALL_GATHER, send, comm, axis, phase)

    def finish() -> list:
        per_rank = launched.wait().view(n, send.numel())
        fulls, off = [], 0
        for t, d, w in zip(moved, dims, wholes):
            count = t.numel() * (t.element_size() if mixed else 1)
            part = per_rank[:, off: off + count]
            off += count
            if mixed:   # its bytes, copied out (aligned for its dtype), read as that dtype
                part = part.clone(memory_format=torch.contiguous_format).view(t.dtype)
            full = part.reshape((n * t.shape[0],) + tuple(t.shape[1:]))[:w]
            fulls.append(full if d == 0 else full.movedim(0, d).contiguous())
        return fulls
    return (launched, finish) if async_op else finish()


def reduce_scatter_flat(grads: list, dims: list, comm: Comm, axis: int):
    """Whole gradients summed over `axis` and split along dims[i], in one asynchronous reduce-scatter.
    Returns (launched, out, pieces): launched.wait() returns the flat result (`out`, for a functional
    collective a tensor to wait on first), and pieces(result, coord) lists this rank's piece of each
    (torch.chunk's) read from it. Only the send buffer (held until the collective completes) keeps the
    gradients' bytes: `pieces` holds their shapes."""
    n = comm.axes[axis].size
    moved = [pad_to(g.movedim(d, 0), n * -(-g.shape[d] // n)).contiguous() for g, d in zip(grads, dims)]
    send = torch.cat([t.reshape(n, -1) for t in moved], dim=1).reshape(-1)   # rank r's pieces together
    layout = [(tuple(t.shape), d, g.shape[d]) for t, d, g in zip(moved, dims, grads)]
    del moved
    launched = launch(REDUCE_SCATTER, send, comm, axis, "backward")

    def pieces(out: torch.Tensor, coord: int) -> list:
        res, off = [], 0
        for shape, d, whole in layout:
            k = math.prod(shape) // n
            piece = out[off: off + k].view((shape[0] // n,) + shape[1:])
            piece = piece[: chunk_span(whole, n, coord)[1]]
            off += k
            res.append(piece if d == 0 else piece.movedim(0, d).contiguous())
        return res
    return launched, launched.result, pieces
