"""FSDP per layer: one flat all-gather and one reduce-scatter for all of a layer's weights.

A weight stored split on a data axis (FSDP) and used whole is gathered where
it is used. One blocking all-gather per weight pays the per-call latency a
dozen times per layer (and as many reduce-scatters in backward). As FSDP2
does, the weights of one layer (cost/layer_groups.layer_of) move together:

    forward   the first weight of the layer an op needs gathers every weight of
              the layer in one all-gather (each rank's pieces padded to equal
              length and concatenated); the others are served from that
    backward  a weight autograd saved is gathered again the same way, once per
              layer; the layer's re-gathered weights are kept until each saved
              use has read them. A checkpointed block saves none (the checkpoint
              keeps its own): its rerun gathers the layer ("recompute"), and that
              gather serves the block's backward. Each of these gathers launches
              the one of the nearest layer before it (in forward order) that this
              backward gathers again (re-gather or recompute) and has not gathered
              yet, ahead of its use, as FSDP2's backward prefetch does: it then
              runs while this layer's backward computes, and goes out on the link
              before this layer's reduce-scatter. (Nearest not yet gathered rather
              than the previous: where a block's weights form two groups -- a norm
              weight whose gradient is summed over tp apart -- the previous group
              is often the block's other one, which backward already holds)
    gradient  each weight's whole gradient goes into the layer's flat buffer;
              once every weight has arrived the buffer is reduce-scattered
              asynchronously, and when backward ends this rank's pieces are summed
              over the group's other axes (`sum_axes`: gradients partial there,
              e.g. norm weights under sequence parallelism) and each weight's .grad
              is set from its piece (added to one already there)

    float8    a float8 linear's weight the plan gathers in float8 (Lowering.float8_gathers,
              torchao's enable_fsdp_float8_all_gather) is cast on each rank before the
              gather, with the whole weight's scale: the layer's shard amaxes go out in
              one all-reduce (MAX) per mesh axis at forward's gather, and backward's and
              a recompute's gathers reuse the scales. The flat gather then moves bytes
              (engine.all_gather_flat), and the member is served as (float8 bits, scale)
              to its Float8Linear (lowering/float8.py), which calls the group itself

The cost model (cost/layer_groups.py) groups the same weights, so the plan's
collectives are the module's.
"""
from __future__ import annotations

import weakref

import torch

from ..._compat import RETURNED, backward_keeps_graph, leaf_gradient_use
from ...sharding.redistribute import ALL_REDUCE
# collectives' shard_dim: uncached, as torch.compile traces these calls (it warns at a functools cache)
from ..collectives import Comm, shard_dim
from ..float8_casts import E4M3, reduce_max, scale_of, to_float8
from .engine import BackwardEnd, InFlight, accumulate_grad, all_gather_flat, launch, reduce_scatter_flat
from .grad_buckets import returned_gradient_error


class _Member:
    def __init__(self, module, param_name: str):
        self.module = module          # the RedistributeModule of this weight
        self.param_name = param_name
        self.expected = 0             # forward uses whose gradient has not arrived
        self.pending_unpacks = 0      # saved uses of the gathered weight backward has still to read
        # forward uses and saved uses since the last backward that did not keep its graph (retain_graph=True):
        # another backward through a kept graph brings as many again
        self.uses = self.saves = 0
        # a float8 linear's weight gathered in float8 (set by the rewriter): the mesh axes over which the amax of
        # its whole weight is reduced (this group's axis and those splitting it at the op); None: gathered as is
        self.float8_axes = None
        self.scale = None             # its float8 scale, made at the step's forward gather


class LayerGroup:
    """The FSDP weights of one layer on one axis; `params()` maps a weight's name to its local shard."""

    def __init__(self, axis: int, comm: Comm, sum_axes: tuple, in_flight: InFlight):
        self.axis, self.comm, self.sum_axes = axis, comm, sum_axes
        self.in_flight = in_flight   # the module's launched reduce-scatters, shared by its groups (in_flight())
        self.params = None          # name -> this rank's shard; set by the ParallelModule that holds them
        self.next = self.prev = None   # the groups forward gathers after and before this one
        self._prefetched = None     # finish() of this group's gather launched ahead of its first use
        # whether a checkpointed region reads this layer's weights, so that backward's rerun of it gathers the
        # layer again (rewrite marks it)
        self.recomputed = False
        self._taken = False         # gathered (or launched ahead) in this backward: not to be prefetched again
        self.members: list[_Member] = []
        self._served: dict = {}     # member index -> gathered weight, handed out once
        self._grads = None          # this backward's whole gradients, until the reduce-scatter takes them
        self._work = None           # the launched reduce-scatter: (launched, its result once waited on, pieces)
        self._end = BackwardEnd(self._finish, self._drop_backward)

    def add(self, module, param_name: str) -> int:
        self.members.append(_Member(module, param_name))
        return len(self.members) - 1

    # ------------------------------------------------------------ gathers
    def gathered(self, i: int, phase: str):
        """Member i's whole weight (of a member gathered in float8: its float8 bits and their scale): from the
        layer's last gather (or the one launched ahead of it), or a new gather of the whole layer; a new gather
        launches the next layer's (in backward and in a recompute: the previous one's, where this backward
        gathers it again) ahead of its use, as FSDP2 prefetches."""
        if i in self._served:
            return self._served.pop(i)
        if self._prefetched is not None:
            fulls, self._prefetched = self._prefetched(), None
        else:
            fulls = self._gather(phase)[1]()
        keep = range(len(self.members)) if phase != "backward" else \
            [k for k, m in enumerate(self.members) if m.pending_unpacks > 0]
        self._served = {k: fulls[k] for k in keep if k != i}
        if phase == "forward":
            ahead = self.next
            if ahead is not None and ahead._prefetched is None and not ahead._served:
                ahead._prefetched = ahead._gather(phase)[1]
        elif phase in ("backward", "recompute"):
            self._taken = True
            self._prefetch_before()
        return fulls[i]

    def _prefetch_before(self) -> None:
        """In backward (a re-gather or a recompute gather): launch the gather of the nearest layer before this one
        (forward order) that this backward gathers again and has not gathered or launched yet."""
        g = self.prev
        while g is not None:
            if not g._taken:
                again = g.gathered_again()
                if again is not None:
                    g._taken = True
                    g._prefetched = g._gather(again)[1]
                    return
            g = g.prev

    def gathered_again(self) -> str | None:
        """The phase in which this backward gathers the layer again: "recompute" where a checkpointed
        block's rerun does, "backward" where saved uses of its weights are still to be read; None if not."""
        if self.recomputed:
            return "recompute"
        return "backward" if any(m.pending_unpacks for m in self.members) else None

    def _gather(self, phase: str):
        locals_ = [self._local(m) for m in self.members]
        wholes = [self._whole(m, x) for m, x in zip(self.members, locals_)]
        float8 = [k for k, m in enumerate(self.members) if m.float8_axes is not None]
        scales = self._float8_scales(locals_, float8, phase) if float8 else {}
        for k in float8:   # cast before the gather: 1 byte an element on the link, and no cast after it
            locals_[k] = to_float8(locals_[k], scales[k], E4M3).view(torch.uint8)
        launched, finish = all_gather_flat(locals_, [self._dim(m) for m in self.members], wholes, self.comm,
                                           self.axis, phase, async_op=True)
        if not float8:
            return launched, finish

        def finish_float8() -> list:
            fulls = finish()
            return [(f.view(E4M3), scales[k]) if k in scales else f for k, f in enumerate(fulls)]
        return launched, finish_float8

    def _float8_scales(self, locals_: list, float8: list, phase: str) -> dict:
        """{member index: its float8 scale} for the members gathered in float8. A forward gather makes them from
        the whole weights' amaxes: the shards' amaxes, all-reduced with MAX in one collective per mesh axis
        for the whole layer (torchao makes one per step for the whole model, after the optimizer step: the
        same scales, fewer launches, and a hook on the optimizer). Backward's and a recompute's gathers reuse
        them: the weights have not changed since."""
        if phase == "forward" or any(self.members[k].scale is None for k in float8):
            amaxes = torch.stack([locals_[k].abs().max().float() if locals_[k].numel()
                                  else locals_[k].new_zeros((), dtype=torch.float32) for k in float8])
            axes = sorted(set().union(*(self.members[k].float8_axes for k in float8)))
            amaxes = reduce_max(amaxes, axes, self.comm, phase)
            for j, k in enumerate(float8):
                self.members[k].scale = scale_of(amaxes[j], E4M3)
        return {k: self.members[k].scale for k in float8}

    def packed(self, i: int) -> None:
        """Autograd saved member i's gathered weight: backward will read it once."""
        self.members[i].pending_unpacks += 1
        self.members[i].saves += 1

    def unpacked(self, i: int) -> torch.Tensor:
        self._queue_end()
        self.members[i].pending_unpacks = max(0, self.members[i].pending_unpacks - 1)
        full = self.gathered(i, "backward")
        if self.members[i].pending_unpacks > 0:   # another saved use reads it later
            self._served[i] = full
        return full

    def forget(self) -> None:
        """Drop gathered weights nothing will read (end of forward; end of backward)."""
        self._served.clear()
        self._taken = False
        if self._prefetched is not None:   # a gather launched ahead (in forward or backward) and never used
            self._prefetched()
            self._prefetched = None

    def _local(self, m: _Member) -> torch.Tensor:
        x = self.params(m.param_name)
        cast = m.module.cast
        return x.detach() if cast is None else x.detach().to(cast[0])

    def _dim(self, m: _Member) -> int:
        return shard_dim(m.module.steps[0].src)

    def _whole(self, m: _Member, local: torch.Tensor) -> int:
        whole = m.module.wholes[0]
        n = self.comm.axes[self.axis].size
        return n * local.shape[self._dim(m)] if whole is None else whole

    # ------------------------------------------------------------ gradients
    def used(self, i: int) -> None:
        self.members[i].expected += 1
        self.members[i].uses += 1

    def arrive(self, i: int, grad: torch.Tensor) -> None:
        """Member i's whole gradient (of all its uses in this forward) reached backward."""
        m = self.members[i]
        self._queue_end()
        if self._work is not None:
            # the layer was reduce-scattered before this gradient came (the counts only time the launch: a second
            # backward through a kept graph, or forwards that never ran backward, can make them wrong): settle that
            # one and reduce this gradient with another
            self._settle()
        m.expected = max(0, m.expected - 1)
        if self._grads is None:
            self._grads = [None] * len(self.members)
        g = grad if m.module.cast is None else grad.to(m.module.cast[1])
        self._grads[i] = g if self._grads[i] is None else self._grads[i] + g
        if all(x.expected == 0 for x in self.members) and self._work is None:
            self._launch()

    def _launch(self) -> None:
        grads = [g if g is not None else self._zeros(k) for k, g in enumerate(self._grads)]
        self._grads = None   # the send buffer holds them from here on
        self.in_flight.make_room()
        self._work = reduce_scatter_flat(grads, [self._dim(m) for m in self.members], self.comm, self.axis)
        self.in_flight.add(self)

    def wait(self) -> None:
        """Wait for this group's reduce-scatter and drop the work, and with it the send buffer."""
        if self._work is None or self._work[0] is None:
            return
        launched, _, pieces = self._work
        self._work = (None, launched.wait(), pieces)

    def _zeros(self, k: int) -> torch.Tensor:
        m = self.members[k]
        local = self._local(m)
        shape = list(local.shape)
        shape[self._dim(m)] = self._whole(m, local)
        dtype = local.dtype if m.module.cast is None else m.module.cast[1]
        return torch.zeros(shape, dtype=dtype, device=local.device)

    def _queue_end(self) -> None:
        """At this group's first part in a backward: refuse torch.autograd.grad with respect to its weights
        (before anything of this backward is kept), and have _finish run when backward ends."""
        if self._end.is_queued():
            return
        for m in self.members:
            p = self.params(m.param_name)
            if p.requires_grad and leaf_gradient_use(torch.autograd.graph.get_gradient_edge(p).node) == RETURNED:
                raise returned_gradient_error(m.param_name, "its layer's FSDP reduce-scatter")
        self._end.queue()

    def _drop_backward(self) -> None:
        """Forget what a backward that raised half did (its gradients never reach .grad)."""
        self.forget()
        self.wait()
        self.in_flight.discard(self)
        self._grads, self._work = None, None
        for m in self.members:
            m.pending_unpacks = m.expected = m.uses = m.saves = 0

    def _finish(self) -> None:
        """End of backward: reduce what has not gone out, set the gradients, drop what was gathered."""
        self.forget()
        kept = backward_keeps_graph()   # another backward through this graph will unpack and arrive as this one did
        for m in self.members:
            if not kept:
                m.uses = m.saves = 0
            m.pending_unpacks, m.expected = m.saves, m.uses
        if self._work is None:
            if self._grads is None:   # no gradient came this backward
                return
            self._launch()
        self._settle()

    def _settle(self) -> None:
        """Complete the launched reduce-scatter: sum this rank's pieces over `sum_axes`, add them to .grad."""
        self.wait()
        self.in_flight.discard(self)
        _, out, pieces = self._work
        for a in self.sum_axes:   # 1/n of the bytes summing the whole gradients first would move
            out = launch(ALL_REDUCE, out, self.comm, a, "backward").wait()
        coord = self.comm.axes[self.axis].coord
        for m, piece in zip(self.members, pieces(out, coord)):
            p = self.params(m.param_name)
            if p.requires_grad:   # a weight frozen since parallelize sent zeros and takes no gradient, as in eager
                accumulate_grad(p, piece.to(p.dtype))
        self._grads, self._work = None, None


def in_flight() -> InFlight:
    """One module's launched layer reduce-scatters, shared by its layer groups: one at a time
    (engine.InFlight says why)."""
    return InFlight(retire=lambda group: group.wait(), limit=1)


class GroupGather(torch.autograd.Function):
    """A grouped weight as its op reads it: gathered with its layer (forward); its whole gradient handed
    to the layer's reduce-scatter, nothing to autograd (the group sets .grad when backward ends)."""
    @staticmethod
    def forward(ctx, local, group: LayerGroup, i: int, phase: str):
        ctx.group, ctx.i = group, i
        return group.gathered(i, phase)

    @staticmethod
    def backward(ctx, grad):
        ctx.group.arrive(ctx.i, grad)
        return None, None, None, None


def serve_layer_groups(pm, registries: list) -> None:
    """Let the FSDP layer groups (layer_groups.py) read this module's shards by name (looked up at each
    use: to_empty and load_state_dict may replace or refill them)."""
    ref = weakref.ref(pm)
    for registry in registries:
        for group in registry.groups:
            group.params = lambda name: ref().store.get_parameter(name)
