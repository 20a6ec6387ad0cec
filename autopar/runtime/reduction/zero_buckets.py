"""ZeRO's gradient reduce-scatters and weight all-gathers, bucketed; ZeRO-2's reductions launched while
backward goes on.

A ZeRO-2 weight's gradient is reduce-scattered into this rank's flat 1/n slice as
soon as autograd has accumulated it (ShardedOptimizer). One blocking
reduce-scatter per weight would wait out each call's latency in the middle of
backward. As DDP does with its all-reduces, the gradients are gathered into
buckets (plan.schedule.zero_buckets, made with cost/buckets.zero_buckets: up to
`bucket_bytes`, in the order backward makes them), and each bucket goes out as
one asynchronous reduce-scatter once all its weights' gradients have come:

    arrive   a weight's gradient is copied into its bucket's send buffer, laid out
             as FSDP2 lays out a reduce-scatter's input (row r: rank r's slice of
             every weight of the bucket), and .grad is dropped: the whole gradient
             does not outlive its arrival
    launch   a full bucket is reduce-scattered asynchronously; buckets launch in
             index order on every rank, and a launch first completes the bucket
             before it (waits, sets its slices' .grad, frees its send buffer), so
             backward holds at most the bucket filling and the one in flight (with
             what the backend copies of it: gloo copies a reduce-scatter's input;
             cost/predict.zero_bucket_hold)
    finish   when backward ends, the last buckets are launched and completed

ZeRO-1 keeps whole gradients through backward and reduces them at the optimizer
step: flush() takes every one into its bucket and reduce-scatters the buckets
then. After the step, gather_weights() all-gathers each bucket's updated slices
in one call (the same buckets, in the weights' dtype) into the whole weights. A
weight on several ZeRO axes, or padded on its axis, stays with the optimizer's
per-weight reduction and gather (ShardedOptimizer._reduce, _gather), one axis
after another.

torch.autograd.grad with respect to a ZeRO weight is refused (refuse_returned_gradient):
it would return this rank's unreduced gradient, which only the step reduces.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..._compat import RETURNED, leaf_gradient_use
from ...errors import PlanError, UnsupportedAutogradError
from ...sharding.redistribute import REDUCE_SCATTER
from ..collectives import Comm
from .engine import BackwardEnd, InFlight, InOrder, accumulate_grad, all_gather_flat, launch


@dataclass
class _Bucket:
    axis: int
    names: list
    columns: dict                                # name -> (first column, columns) of its slice in each row
    width: int                                   # elements of one row: one rank's slices
    send: torch.Tensor | None = None             # [ranks, width], this backward's, taken at the first arrival
    arrived: set = field(default_factory=set)    # names whose gradient is in `send`
    launched: object = None                      # the reduce-scatter (engine.Launched)


class ZeroBuckets:
    """`buckets`: (axis index, [parameter names]) in launch order; `zero`: name -> the optimizer's _ZeroParam;
    `phase`: where they run (the collectives' log): "backward" (ZeRO-2, arrive()) or "optimizer" (flush())."""

    def __init__(self, buckets: list, zero: dict, comm: Comm, phase: str):
        self.comm, self.zero, self.phase = comm, zero, phase
        self.buckets = []
        for axis, names in buckets:
            n, columns, width = comm.axes[axis].size, {}, 0
            for name in names:   # a bucketed weight's flat size divides by its axis (cost/buckets.zero_buckets)
                columns[name] = (width, zero[name].param.numel() // n)
                width += columns[name][1]
            self.buckets.append(_Bucket(axis, list(names), columns, width))
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        self._order = InOrder(self.buckets, lambda b: len(b.arrived) == len(b.names),
                              lambda b: self._launch(b))
        self._in_flight = InFlight(retire=self._complete, limit=1)   # one launched bucket not yet completed
        self._end = BackwardEnd(self._finish, self._drop_backward)

    def __contains__(self, name: str) -> bool:
        return name in self._bucket_of

    def arrive(self, name: str) -> None:
        """The weight's gradient has been accumulated for this backward (ZeRO-2): into its bucket."""
        b = self.buckets[self._bucket_of[name]]
        if b.launched is not None:
            raise PlanError(f"the gradient of {name!r} came after its ZeRO bucket was reduce-scattered in this "
                            "backward (a second backward through the same graph before it ended?); report this")
        self._end.queue()
        self._take(b, name)
        self.zero[name].param.grad = None   # the point of level 2: the whole gradient does not outlive this
        self._order.advance()

    def _take(self, b: _Bucket, name: str) -> None:
        z = self.zero[name]
        n = self.comm.axes[b.axis].size
        if b.send is None:
            b.send = torch.empty((n, b.width), dtype=z.reduce_dtype, device=z.param.device)
        first, k = b.columns[name]
        b.send[:, first: first + k].copy_(z.param.grad.reshape(n, k))   # in the reduce dtype
        b.arrived.add(name)

    def _launch(self, b: _Bucket) -> None:
        if not b.arrived:
            return
        for name in b.names:   # no gradient this backward (an unused weight): it adds nothing, and gets none
            if name not in b.arrived:
                first, k = b.columns[name]
                b.send[:, first: first + k].zero_()
        self._in_flight.make_room()
        self._in_flight.add(b)
        b.launched = launch(REDUCE_SCATTER, b.send.reshape(-1), self.comm, b.axis, self.phase)
        b.send = None   # the launched collective holds it until it completes

    def flush(self) -> None:
        """Reduce every weight's accumulated gradient now (ZeRO-1, at the optimizer step); .grad stays."""
        for b in self.buckets:
            for name in b.names:
                if self.zero[name].param.grad is not None:
                    self._take(b, name)
            self._launch(b)
        self._in_flight.drain()

    def gather_weights(self) -> None:
        """After the optimizer step: each bucket's updated slices all-gathered in one call, and each whole
        weight set from them (rank r's slice of a weight is its r-th 1/n, so the whole flat weight is its
        column of every rank's row)."""
        for b in self.buckets:
            zs = [self.zero[name] for name in b.names]
            wholes = all_gather_flat([z.slice.detach().reshape(-1) for z in zs], [0] * len(zs),
                                     [z.param.numel() for z in zs], self.comm, b.axis, "optimizer")
            for z, whole in zip(zs, wholes):
                z.param.copy_(whole.view_as(z.param))

    def _finish(self) -> None:
        """End of backward: launch what has not launched, complete the last."""
        self._order.rest()
        self._in_flight.drain()

    def _drop_backward(self) -> None:
        """Forget what a backward that raised half did (its gradients never reach the slices); a launched
        reduce-scatter is waited on, as every rank launched it."""
        for b in self._in_flight.entries:
            b.launched.wait()
        self._in_flight.entries.clear()
        for b in self.buckets:
            b.send, b.launched, b.arrived = None, None, set()
        self._order.next = 0

    def _complete(self, b: _Bucket) -> None:
        """Wait for bucket b's reduce-scatter and add this rank's slices to the slices' .grad."""
        out = b.launched.wait()
        for name in b.arrived:   # one without a gradient stays without one, as an unbucketed weight would
            first, k = b.columns[name]
            z = self.zero[name]
            accumulate_grad(z.slice, out[first: first + k].to(z.slice.dtype))
        b.arrived, b.launched = set(), None


class ZeroGradientChecks:
    """Each ZeRO parameter's (plan.param_zero) checks of its gradient, on a ParallelModule's parameters: an
    optimizer that is not autopar.ShardedOptimizer is refused at the first backward (a plain torch optimizer
    would step on this rank's unreduced gradient: wrong, silently), and torch.autograd.grad with respect to
    the parameter at any (refuse_returned_gradient). Not the latter under a pipeline: train_step runs its
    backwards itself, and the zero-bubble schedule's own autograd.grad towards the weights must go through."""

    def __init__(self, pm):
        self._pm = weakref.ref(pm)   # the hooks live on its parameters
        self._hooked = {}   # ZeRO parameter name -> the parameter hooked

    def hook(self) -> None:
        """Hook the parameters not hooked yet (to_empty, for a meta-built model, replaces them)."""
        pm = self._pm()
        for fqn, p in pm.store.named_parameters():
            if fqn not in pm.plan.param_zero or not p.requires_grad or self._hooked.get(fqn) is p:
                continue
            p.register_post_accumulate_grad_hook(self._check_optimizer)
            if pm.plan.pipeline is None:
                p.register_hook(refuse_returned_gradient(p, fqn))
            self._hooked[fqn] = p

    def _check_optimizer(self, param) -> None:
        if self._pm().zero_optimizer is None:
            raise PlanError("this plan splits some parameters' optimizer state ZeRO-style (plan.param_zero), "
                            "so their gradients are reduced by the optimizer wrapper, not in backward: create "
                            "the optimizer as autopar.ShardedOptimizer(model, torch.optim.AdamW, lr=...) "
                            "before the first backward")


def refuse_returned_gradient(param: torch.nn.Parameter, name: str):
    """A tensor hook for ZeRO parameter `param` (named `name`) that raises UnsupportedAutogradError when the
    backward now running hands its gradient back to its caller (torch.autograd.grad) instead of to .grad.

    No autograd function of ours reads a ZeRO weight (ShardedOptimizer reduces its gradient from .grad), so
    the check rides on the weight's own gradient: one call per backward that reaches it, nothing in forward.
    Holds the parameter weakly: the hook lives on it."""
    ref = weakref.ref(param)

    def hook(grad):
        p = ref()
        if p is not None and leaf_gradient_use(torch.autograd.graph.get_gradient_edge(p).node) == RETURNED:
            raise zero_returned_gradient_error(name)

    return hook


def zero_returned_gradient_error(name: str) -> UnsupportedAutogradError:
    return UnsupportedAutogradError(
        f"torch.autograd.grad with respect to parameter {name!r} is not supported under this plan: its optimizer "
        "state is split ZeRO-style (plan.param_zero), so its gradient is reduced across ranks by "
        "autopar.ShardedOptimizer from .grad (in its step; at level 2 as backward accumulates it), and "
        "autograd.grad would get this rank's unreduced share. Call loss.backward() and read the whole gradients "
        "with opt.full_grads() on the ShardedOptimizer (a ZeRO parameter's p.grad is this rank's unreduced share "
        "at level 1, and None at level 2, reduced into the optimizer's slice); torch.autograd.grad with respect "
        "to the inputs works")
