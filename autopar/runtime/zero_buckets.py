"""ZeRO-2's gradient reduce-scatters, bucketed and launched while backward goes on.

A ZeRO-2 weight's gradient is reduce-scattered into this rank's flat 1/n slice as
soon as autograd has accumulated it (ShardedOptimizer). One blocking
reduce-scatter per weight would wait out each call's latency in the middle of
backward. As DDP does with its all-reduces, the gradients are gathered into
buckets (cost/buckets.zero_buckets: up to `bucket_bytes`, in the order backward
makes them), and each bucket goes out as one asynchronous reduce-scatter once
all its weights' gradients have come:

    arrive   a weight's gradient is taken from .grad (level 2: the whole gradient
             does not outlive backward past its bucket's launch)
    launch   a full bucket is reduce-scattered asynchronously, FSDP2's layout
             (collectives.reduce_scatter_flat: rank r's slice of every weight
             together); buckets launch in index order on every rank
    finish   when backward ends, every bucket is waited on and each slice's .grad
             set from it (added to one there)

A weight on several ZeRO axes, or whose gradient never comes in some backward,
stays with the optimizer's per-weight reduction (ShardedOptimizer._reduce).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._compat import at_backward_end
from ..errors import PlanError
from .collectives import Comm, reduce_scatter_flat


@dataclass
class _Bucket:
    axis: int
    names: list
    grads: dict = field(default_factory=dict)   # name -> flat gradient in the reduce dtype, until launch
    launched: object = None                      # (work, pieces) of the reduce-scatter


class ZeroBuckets:
    """`buckets`: (axis index, [parameter names]) in launch order; `zero`: name -> the optimizer's _ZeroParam."""

    def __init__(self, buckets: list, zero: dict, comm: Comm):
        self.comm, self.zero = comm, zero
        self.buckets = [_Bucket(axis, list(names)) for axis, names in buckets]
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        self._next_launch = 0
        self._callback_queued = False

    def __contains__(self, name: str) -> bool:
        return name in self._bucket_of

    def arrive(self, name: str) -> None:
        """The weight's gradient has been accumulated for this backward: take it into its bucket."""
        z = self.zero[name]
        b = self.buckets[self._bucket_of[name]]
        if b.launched is not None:
            raise PlanError(f"the gradient of {name!r} came after its ZeRO bucket was reduce-scattered in this "
                            "backward (a second backward through the same graph before it ended?); report this")
        if not self._callback_queued:
            self._callback_queued = True
            at_backward_end(self._finish)
        b.grads[name] = z.param.grad.reshape(-1).to(z.reduce_dtype)
        z.param.grad = None   # the point of level 2: the whole gradient does not outlive its bucket's launch
        while self._next_launch < len(self.buckets) and self._full(self.buckets[self._next_launch]):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    @staticmethod
    def _full(b: _Bucket) -> bool:
        return len(b.grads) == len(b.names)

    def _launch(self, b: _Bucket) -> None:
        missing = [n for n in b.names if n not in b.grads]
        if len(missing) == len(b.names):
            return
        for n in missing:   # no gradient this backward (an unused weight): it adds nothing, and gets none
            z = self.zero[n]
            b.grads[n] = torch.zeros(z.param.numel(), dtype=z.reduce_dtype, device=z.param.device)
        grads = [b.grads[n] for n in b.names]
        b.grads = {n: None for n in b.names if n not in missing}   # the send buffer holds them now
        work, _, pieces = reduce_scatter_flat(grads, [0] * len(grads), self.comm, b.axis)
        b.launched = (work, pieces)

    def _finish(self) -> None:
        """End of backward: launch what has not launched, wait for every bucket, set the slices' gradients."""
        self._callback_queued = False
        for b in self.buckets[self._next_launch:]:
            self._launch(b)
        self._next_launch = 0
        coord = {axis: self.comm.axes[axis].coord for axis in {b.axis for b in self.buckets}}
        for b in self.buckets:
            if b.launched is None:
                continue
            work, pieces = b.launched
            t0 = self.comm.start()
            work.wait()
            self.comm.stop(b.axis, t0)
            for n, g in zip(b.names, pieces(coord[b.axis])):
                if n not in b.grads:   # had no gradient: stays without one, as an unbucketed weight would
                    continue
                z = self.zero[n]
                g = g.to(z.slice.dtype)
                z.slice.grad = g if z.slice.grad is None else z.slice.grad + g
            b.grads, b.launched = {}, None
