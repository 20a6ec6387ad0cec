"""Gradient buckets: the data-parallel gradient reductions, launched while backward goes on.

A weight replicated on a data axis gets, on each rank, the gradient of that
rank's share of the batch: a partial sum over the axis. Reducing each one
where autograd makes it would be one blocking all-reduce per weight. Instead
the local graph leaves those gradients partial (the plan's lowering.Lowering.partial_gradients) and
this module does what DDP's reducer does:

    arrive   a weight's partial gradient reaches DeferredReduce.backward and is
             copied into its bucket's flat buffer (in the reduce dtype)
    launch   a bucket all of whose weights have arrived is all-reduced
             asynchronously; buckets launch in index order on every rank, so
             the ranks' collectives match
    finish   when backward ends (an autograd-engine callback) every bucket is
             waited on and each weight's .grad set from it (added to one there)

Buckets hold weights of one (axes, dtypes) kind, in the reverse order of their
first use in forward -- the order backward makes their gradients -- up to
`bucket_bytes` each: the plan lists them (plan.schedule.grad_buckets, made by
planning/schedule.py with cost/buckets.assign_buckets) and this module runs them. Under `accumulating()` (no_sync, and a pipeline's
microbatches) gradients are summed locally and reduced once by `flush()`.

The counts of uses still to arrive only time the launches: a gradient that
arrives after its bucket was launched in this backward (a second backward
through a graph kept with retain_graph=True, or the counts of forwards that
never ran backward) completes that bucket and starts it again, reduced when
backward ends. torch.autograd.grad with respect to a routed weight is refused
(returned_gradient_error): its gradient goes to the buckets, not back to the
caller.

The weight's gradient never goes through autograd's own accumulation: .grad
only ever holds reduced values, so accumulating over steps without no_sync
stays right (a partial sum added to a reduced one could not be reduced again).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..._compat import RETURNED, TO_GRAD, backward_keeps_graph, leaf_gradient_use
from ...capture.export import PARAM
from ...errors import PlanError, UnsupportedAutogradError
from ...sharding.redistribute import ALL_REDUCE
from ..collectives import Comm
from .engine import BackwardEnd, InOrder, accumulate_grad, launch

# the `where` of a bucket's all-reduce in a plan's collectives (cost/overlap.BUCKET; tests/test_layering.py
# holds the two equal)
BUCKET = "gradient bucket "


@dataclass
class _Slot:
    name: str
    param: torch.nn.Parameter
    bucket: int
    offset: int
    outstanding: int = 0   # forward uses whose gradient has not arrived yet
    uses: int = 0          # forward uses since the last backward that did not keep its graph


@dataclass
class _Bucket:
    axes: tuple                 # mesh axes the gradients are summed over
    reduce_dtype: torch.dtype   # the dtype they travel in (a precision policy's reduce dtype)
    slots: list = field(default_factory=list)
    numel: int = 0
    flat: torch.Tensor | None = None   # this backward's buffer, taken at the first arrival
    buffer: torch.Tensor | None = None  # the buffer kept from step to step (the .grad views point into it)
    written: set = field(default_factory=set)   # slots whose piece of `flat` holds a gradient
    outstanding: int = 0               # its slots' forward uses whose gradient has not arrived
    work: object = None                # the launched all-reduce on axes[0] (engine.Launched)


class DeferredReduce(torch.autograd.Function):
    """Identity forward on a group of weights; backward hands their partial gradients to the buckets and
    gives autograd nothing to accumulate (the buckets set .grad once it is reduced).

    One node for several weights, not one each: each node costs Python in forward and again in backward
    (~10 us to apply), and one per weight made 65 on the benchmark GPT, grouped 23 (route_through_buckets)."""
    @staticmethod
    def forward(ctx, buckets: "GradBuckets", slots: tuple, *params):
        # whether to reduce is decided in forward, as DDP's no_sync does: a forward run inside no_sync()
        # accumulates even when its backward runs outside
        ctx.buckets, ctx.slots, ctx.accumulate = buckets, slots, buckets._accumulating
        ctx.through_autograd = buckets._through_autograd
        ctx.set_materialize_grads(False)   # a weight whose gradient did not come: None, not a tensor of zeros
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.through_autograd:   # see GradBuckets.through_autograd
            for i in ctx.slots:
                ctx.buckets.passed(i)
            return (None, None, *grads)
        slots = ctx.buckets.slots
        grads = to_grad(grads, ctx.next_functions, lambda k: slots[ctx.slots[k]].name, "a gradient bucket's all-reduce")
        ctx.buckets.arrive(ctx.slots, grads, ctx.accumulate)
        return (None, None) + (None,) * len(grads)


def to_grad(grads: tuple, next_functions, name_of, reduction: str) -> tuple:
    """`grads` of the weights whose gradient accumulators are `next_functions` (the reading op's ctx), with
    None for one the backward now running does not accumulate into .grad (backward(inputs=) naming other
    tensors); refuses torch.autograd.grad with respect to one (`name_of(k)`: the k-th weight's name)."""
    out = []
    for k, (grad, (node, _)) in enumerate(zip(grads, next_functions)):
        use = TO_GRAD if node is None else leaf_gradient_use(node)
        if use == RETURNED:
            raise returned_gradient_error(name_of(k), reduction)
        out.append(grad if use == TO_GRAD else None)
    return tuple(out)


def returned_gradient_error(name: str, reduction: str) -> UnsupportedAutogradError:
    return UnsupportedAutogradError(
        f"torch.autograd.grad with respect to parameter {name!r} is not supported under this plan: the module "
        f"reduces its gradient across ranks itself ({reduction}) as backward makes it, and sets .grad when "
        "backward ends, so autograd.grad would get None (or this rank's unreduced share). Call loss.backward() and "
        "read p.grad (pm.full_grads() for whole gradients); torch.autograd.grad with respect to the inputs works")


class GradBuckets:
    """The bucketed reductions of one ParallelModule's weights whose gradients the graph leaves partial.

    `buckets`: the plan's buckets on this device (planning.schedule.Schedule.grad_buckets), in launch order:
    (mesh axis indices, [(name, parameter, reduce dtype)] in the order backward makes their gradients)."""

    def __init__(self, buckets: list, comm: Comm, grad_scale: float = 1.0):
        self.comm = comm
        # the outputs' gradient factor, applied here as each gradient comes in (cost/buckets.bucket_grad_scale)
        self.grad_scale = grad_scale
        self.slots: list[_Slot] = []
        self.buckets: list[_Bucket] = []
        self._slot_of: dict[str, int] = {}
        for axes, entries in buckets:   # the plan's (planning/schedule.py): the module launches what the plan lists
            dtypes = {dt for _, _, dt in entries}
            if len(dtypes) > 1:
                raise PlanError(f"weights {[n for n, _, _ in entries][:3]} share a gradient bucket but reduce in "
                                f"{sorted(map(str, dtypes))}: give them one reduce dtype (precision=)")
            bucket = _Bucket(tuple(axes), dtypes.pop())
            for name, p, _ in entries:
                self._slot_of[name] = len(self.slots)
                bucket.slots.append(len(self.slots))
                self.slots.append(_Slot(name, p, len(self.buckets), bucket.numel))
                bucket.numel += p.numel()
            self.buckets.append(bucket)
        self._pending: dict[int, torch.Tensor] = {}   # slot -> local gradient summed under accumulating()
        self._last_read: set = set()   # slots read for the last time this step (last_read), under accumulating()
        self._accumulating = False
        self._through_autograd = False
        self._order = InOrder(self.buckets, lambda b: b.flat is not None and b.outstanding == 0,
                              lambda b: self._launch(b))   # looked up at each launch: tests wrap it
        self._end = BackwardEnd(self._finish, self._drop_backward)
        self._reducing = False

    def use(self, names: list, params: list) -> list:
        """The weights as forward reads them: those whose gradient is bucketed routed through one
        DeferredReduce, the others as they are."""
        ks = [k for k, name in enumerate(names) if name in self._slot_of]
        out = list(params)
        for k, view in zip(ks, self.use_slots(tuple(self._slot_of[names[k]] for k in ks), [params[k] for k in ks])):
            out[k] = view
        return out

    def use_slots(self, slots: tuple, params) -> tuple:
        """`params`, the weights of `slots` (indices into self.slots), as forward reads them: through one
        DeferredReduce, but for a weight that takes no gradient now (frozen after parallelize, or grad
        disabled), which autograd would not hand to the node."""
        if not torch.is_grad_enabled():
            return tuple(params)
        ks = [k for k, p in enumerate(params) if p.requires_grad]
        if not ks:
            return tuple(params)
        for k in ks:
            slot = self.slots[slots[k]]
            # the parameter forward reads now: to_empty (a meta-built model) replaces the ones made at construction
            slot.param = params[k]
            slot.outstanding += 1
            slot.uses += 1
            self.buckets[slot.bucket].outstanding += 1
        out = list(params)
        for k, view in zip(ks, DeferredReduce.apply(self, tuple(slots[k] for k in ks), *(params[k] for k in ks))):
            out[k] = view
        return tuple(out)

    def slot(self, name: str) -> int | None:
        """The index of the weight's slot, None for a weight these buckets do not reduce."""
        return self._slot_of.get(name)

    def routable(self, busy_axes: set) -> set:
        """Names of the weights whose bucket may launch while backward runs: those on axes where nothing else
        communicates in backward. On an axis that also carries backward's own collectives (a tensor-parallel
        axis reducing norm weights under sequence parallelism, a data axis FSDP reduce-scatters on) a
        launch between two of those could come in another order on another rank; there the buckets
        launch when backward ends, after all of them."""
        return {s.name for s in self.slots if not set(self.buckets[s.bucket].axes) & busy_axes}

    @contextlib.contextmanager
    def accumulating(self):
        """Gradients computed inside are summed on this rank, not reduced: the next synced backward (or
        flush()) reduces their sum once."""
        was, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = was
            if not was:
                self._last_read.clear()

    def last_read(self, names: list) -> None:
        """Under accumulating(): the weights `names` will not be read again before flush() (a pipeline stage's
        last microbatch has read them), so once their gradients have all come, a bucket of such weights only
        reduces while the rest of the schedule runs, waited for by flush(). Only when it reduces depends on
        this: a gradient that comes after its bucket launched is reduced again by flush(), and the sum is the
        same."""
        if self._accumulating:
            self._last_read.update(i for i in map(self._slot_of.get, names) if i is not None)

    @contextlib.contextmanager
    def through_autograd(self):
        """Inside, gradients go through autograd to .grad, summed there unreduced; on leaving they move
        to the buckets as if summed under accumulating(), and .grad gets back what it held.

        For torch's zero-bubble schedules: they compute weight gradients in a pass of their own, with
        torch.autograd.grad towards each weight's gradient accumulator, which must be given one."""
        held = {i: s.param.grad for i, s in enumerate(self.slots)}
        for s in self.slots:
            s.param.grad = None
        was, self._through_autograd = self._through_autograd, True
        try:
            yield
        finally:
            self._through_autograd = was
            for i, s in enumerate(self.slots):
                g, s.param.grad = s.param.grad, held[i]
                if g is not None:
                    self._pending[i] = g if i not in self._pending else self._pending[i] + g

    def passed(self, i: int) -> None:
        """Slot i's gradient went through autograd (through_autograd): one use fewer to wait for."""
        slot = self.slots[i]
        if slot.outstanding > 0:
            slot.outstanding -= 1
            self.buckets[slot.bucket].outstanding -= 1

    def arrive(self, slots: tuple, grads: tuple, accumulate: bool = False) -> None:
        """The gradients of one DeferredReduce's weights (None where one did not come) are in."""
        self._end.queue()
        summing = accumulate or self._accumulating
        for i, grad in zip(slots, grads):
            slot = self.slots[i]
            if slot.outstanding > 0:
                slot.outstanding -= 1
                self.buckets[slot.bucket].outstanding -= 1
            if grad is None:
                continue
            if summing:
                self._pending[i] = grad if i not in self._pending else self._pending[i] + grad
            else:
                self._reducing = True   # this backward reduces: _finish completes it
                self._copy_in(i, grad)
        if not summing:
            self._order.advance()
        elif self._last_read:
            self._launch_summed({self.slots[i].bucket for i in slots})

    def _launch_summed(self, buckets: set) -> None:
        """Launch each of `buckets` (indices) whose weights were all read for the last time (last_read) and
        have all their gradients: their sums are whole. Every rank of the axis runs the same stages in the
        same order, so the launches match."""
        for k in sorted(buckets):
            b = self.buckets[k]
            if b.work is None and all(i in self._last_read and self.slots[i].outstanding == 0 for i in b.slots):
                self._take_pending(b)
                self._launch(b)

    def _copy_in(self, i: int, grad: torch.Tensor) -> None:
        slot = self.slots[i]
        b = self.buckets[slot.bucket]
        if b.work is not None:   # launched before this gradient came: reduce it with a second launch at the end
            self._complete(b)
        self._add(b, i, grad)
        pending = self._pending.pop(i, None)
        if pending is not None:
            self._add(b, i, pending)

    def _add(self, b: _Bucket, i: int, grad: torch.Tensor) -> None:
        """Slot i's piece of the bucket += grad; the first gradient is copied in (no zero-fill of the
        whole bucket each step: _launch zeroes only the pieces no gradient reached)."""
        slot = self.slots[i]
        if b.flat is None:
            b.flat = self._buffer(b, slot.param.device)
        piece, grad, scale = b.flat[slot.offset: slot.offset + slot.param.numel()], grad.reshape(-1), self.grad_scale
        if i in b.written:
            piece.add_(grad, alpha=scale)
        elif scale == 1.0:
            piece.copy_(grad)
        elif grad.dtype == piece.dtype:
            torch.mul(grad, scale, out=piece)   # the copy and the scale in one pass
        else:   # multiplied in the bucket's dtype, not in a narrower one the gradient may come in
            piece.copy_(grad).mul_(scale)
        b.written.add(i)

    def _buffer(self, b: _Bucket, device) -> torch.Tensor:
        """The bucket's buffer for this backward: the last step's again, as DDP keeps its buckets (no
        allocation of tens of MB each step), unless a .grad still views it (gradients kept across steps,
        no zero_grad): writing into it would change them."""
        kept = b.buffer
        if kept is None or kept.device != torch.device(device) or any(
                self._views(self.slots[i].param.grad, kept) for i in b.slots):
            kept = b.buffer = torch.empty(b.numel, dtype=b.reduce_dtype, device=device)
        return kept

    @staticmethod
    def _views(grad, buffer: torch.Tensor) -> bool:
        return grad is not None and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    def _launch(self, b: _Bucket) -> None:
        if b.flat is None:   # nothing arrived, but the slots may hold gradients summed under accumulating()
            self._take_pending(b)
        if b.flat is None:
            return
        for i in b.slots:   # a weight whose gradient did not come adds nothing
            if i not in b.written:
                slot = self.slots[i]
                b.flat[slot.offset: slot.offset + slot.param.numel()].zero_()
        b.work = launch(ALL_REDUCE, b.flat, self.comm, b.axes[0], "backward")

    def _take_pending(self, b: _Bucket) -> None:
        for i in b.slots:
            g = self._pending.pop(i, None)
            if g is not None:
                self._add(b, i, g)

    def _finish(self) -> None:
        """End of backward: launch what has not launched, wait for all, set the gradients."""
        if self._reducing:   # else every gradient of this backward was only summed (no_sync)
            self._reducing = False
            for b in self.buckets:   # in index order, as on every rank; those launched in backward are on their way
                if b.work is None:
                    self._take_pending(b)
                    self._launch(b)
            self._order.next = 0
            for b in self.buckets:
                self._complete(b)
        self._count_uses_again(backward_keeps_graph())

    def _drop_backward(self) -> None:
        """Forget what a backward that raised half did (its gradients never reach .grad); its launched
        all-reduces are waited on, as every rank launched them."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.flat, b.work, b.outstanding = None, None, 0
            b.written.clear()
        for s in self.slots:
            s.outstanding = s.uses = 0
        self._order.next, self._reducing = 0, False

    def _count_uses_again(self, graph_kept: bool) -> None:
        """A backward that keeps its graph may be followed by another through it, which brings the gradients
        of the same uses again: wait for them as for this one's."""
        for s in self.slots:
            if graph_kept:
                s.outstanding = s.uses
            else:
                s.uses = 0
        if graph_kept:
            for b in self.buckets:
                b.outstanding = sum(self.slots[i].outstanding for i in b.slots)

    def flush(self) -> None:
        """Reduce every gradient summed under accumulating() now (a pipeline's step ends with this)."""
        for b in self.buckets:
            if b.work is not None and any(i in self._pending for i in b.slots):
                self._complete(b)   # launched early (last_read), a gradient came since: reduced again
            if b.work is None:
                self._take_pending(b)
                self._launch(b)
        for b in self.buckets:
            self._complete(b)

    def _complete(self, b: _Bucket) -> None:
        if b.work is None:
            return
        flat = b.work.wait()
        for a in b.axes[1:]:   # a weight partial over several axes: the others after the first, in turn
            flat = launch(ALL_REDUCE, flat, self.comm, a, "backward").wait()
        for i in b.slots:
            p = self.slots[i].param
            if p.requires_grad:   # a weight frozen since parallelize sent zeros and takes no gradient, as in eager
                accumulate_grad(p, flat[self.slots[i].offset: self.slots[i].offset + p.numel()].view(p.shape).to(p.dtype))
        b.flat, b.work, b.outstanding = None, None, 0
        b.written.clear()
        for i in b.slots:
            self.slots[i].outstanding = 0

    def num_buckets(self) -> int:
        return len(self.buckets)


class BucketedUse(torch.nn.Module):
    """A group of weights as the graph reads them where it first uses them: through GradBuckets.use_slots.

    Autograd runs a backward node in the reverse order of creation among those ready. A DeferredReduce
    applied before the graph runs is the oldest node there, so it would run, and its bucket launch, only
    once all of backward had (every weight's gradient held until then, nothing reduced while backward
    computes). Applied just before the first use of its group's first-used weight, it runs as soon as the
    group's gradients are made. Under torch.compile the module applies them before the graph instead
    (ParallelModule._graph_args) and this is the identity: the compiled graph is one autograd node, whose
    gradients all come at its end."""

    def __init__(self):
        super().__init__()
        self.buckets: GradBuckets | None = None   # set by the ParallelModule that owns the buckets

    def forward(self, slots: tuple, *params: torch.Tensor) -> tuple:
        if self.buckets is None or torch.compiler.is_dynamo_compiling():
            return params
        return self.buckets.use_slots(slots, params)


# The most bytes of weights one DeferredReduce routes. Its node runs once all of its weights' gradients are
# made, so it holds those made first until then: at most this many bytes more than one weight's. 1 MiB
# groups the benchmark GPT's 65 weights into 23 nodes, a matrix with its bias and the norms beside it.
ROUTE_GROUP_BYTES = 2**20


def route_through_buckets(gm, placeholder_names: dict, buckets: GradBuckets) -> BucketedUse:
    """Insert BucketedUse calls in `gm` for the bucketed weights (`placeholder_names`: placeholder -> the
    weight's name): the weights taken in the order the graph first reads them, in groups of consecutive
    ones of one bucket up to ROUTE_GROUP_BYTES, each group's call before its first weight's first use.
    Returns the module, given `buckets`."""
    import operator
    route = BucketedUse()
    route.buckets = buckets
    gm.add_module("bucketed_use", route)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    firsts = []   # (first user, placeholder, slot) per routed weight
    for node in gm.graph.nodes:
        name = placeholder_names.get(node.name) if node.op == "placeholder" else None
        if name is not None and node.users and buckets.slot(name) is not None:
            firsts.append((min(node.users, key=order.get), node, buckets.slot(name)))
    firsts.sort(key=lambda f: order[f[0]])
    groups, size = [], 0
    for first, node, i in firsts:
        slot = buckets.slots[i]
        nbytes = slot.param.numel() * slot.param.element_size()
        if not groups or buckets.slots[groups[-1][-1][2]].bucket != slot.bucket or size + nbytes > ROUTE_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((first, node, i))
        size += nbytes
    for group in groups:
        with gm.graph.inserting_before(group[0][0]):
            used = gm.graph.call_module("bucketed_use", (tuple(i for _, _, i in group), *(n for _, n, _ in group)))
            views = [gm.graph.call_function(operator.getitem, (used, k)) for k in range(len(group))]
        for (_, node, _), view in zip(group, views):
            node.replace_all_uses_with(view, delete_user_cb=lambda user: user is not used)
    gm.graph.lint()
    gm.recompile()
    return route


def grad_buckets_of(cap, plan, comm, grad_nodes, params: dict, grad_scale: float, coord: int) -> "GradBuckets":
    """The plan's gradient buckets for this device (pipeline coordinate `coord`; 0 when not pipelined), over
    the weights whose gradient the graph leaves partial (the plan's Lowering.partial_gradients) and this device holds
    (`params`). The plan's buckets must cover exactly those weights, on the axes their gradients are left
    partial: a plan whose schedule was made for another graph or other stages is refused, not run with some
    gradient unreduced."""
    policy, names = plan.precision_policy, plan.mesh.axis_names
    deferred = {cap.info[n].target_name: tuple(names[a] for a in axes)
                for n, axes in plan.schedule.lowering.partial_gradients.items()
                if cap.info[n].kind == PARAM and cap.info[n].target_name in params}
    planned = plan.schedule.grad_buckets.get(coord, ())
    # a weight planned as trained and frozen now takes no gradient: its slot reduces zeros, handed to nobody
    listed = [w for b in planned for w in b.weights if w not in cap.frozen_params]
    wrong_axes = [w for b in planned for w in b.weights if w in deferred and deferred[w] != tuple(b.axes)]
    if sorted(listed) != sorted(deferred) or wrong_axes:
        missing, extra = sorted(set(deferred) - set(listed)), sorted(set(listed) - set(deferred))
        raise PlanError(f"the plan's gradient buckets do not fit this module (device {coord} of the pipeline axis)"
                        f": weights to reduce it lists nowhere {missing[:3]}, weights it lists that need no bucket "
                        f"here {extra[:3]}, weights on other axes {wrong_axes[:3]}; the plan's schedule was made for "
                        "another model or other stages, or for the model with weights frozen (requires_grad False) "
                        "that it trains now: plan again (autopar.plan)")

    def entry(fqn):
        return fqn, params[fqn], policy.resolve(cap.param_dtypes.get(fqn, params[fqn].dtype)).reduce
    return GradBuckets([([names.index(a) for a in b.axes], [entry(w) for w in b.weights]) for b in planned],
                       comm, grad_scale)


def wire_grad_buckets(cap, plan, comm, grad_nodes, params: dict, graph_modules: list, placeholder_sources: list):
    """(the GradBuckets of a module's weights `params`, the names of those its graphs route through them at
    their first use). A routed weight's bucket reduces as soon as backward has made its gradients; the
    others' buckets reduce when backward ends (GradBuckets.routable says which may launch early).
    `placeholder_sources`: (kind, name) per placeholder of each graph (runtime/store.py)."""
    scale = graph_modules[0].meta["bucket_grad_scale"]   # rewrite() sets it on every graph it makes
    if any(g.meta["bucket_grad_scale"] != scale for g in graph_modules[1:]):
        raise PlanError("the two modes' graphs scale the outputs' gradient in different places; report this")
    coord = comm.axes[plan.mesh.axis_index(plan.pipeline.axis)].coord if plan.pipeline is not None else 0
    buckets = grad_buckets_of(cap, plan, comm, grad_nodes, params, scale, coord)
    routed = set() if plan.pipeline is not None else buckets.routable(_backward_axes(plan))
    for graph_module in graph_modules:
        placeholders = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
        names = {ph: fqn for ph, (kind, fqn) in zip(placeholders, placeholder_sources)
                 if kind == PARAM and fqn in routed}
        route_through_buckets(graph_module, names, buckets)
    return buckets, routed


def _backward_axes(plan) -> set:
    """Mesh axes (indices) on which some collective other than a gradient bucket's runs during backward."""
    return {plan.mesh.axis_names.index(c.axis) for c in plan.collectives
            if c.phase not in ("forward", "optimizer") and not c.where.startswith(BUCKET)}
