"""FSDP under a pipeline as practitioners run it: weights gathered once per step and held whole.

With `plan.reshard_after_forward` False on a pipelined plan, each FSDP weight
this device's stages read is all-gathered once per train_step, before the
schedule runs, and held whole while every microbatch runs; the stage graphs
read the held tensor (a leaf of its own) instead of gathering it themselves.
Each microbatch's gradient of it is summed, whole, in the reduce dtype (a
post-accumulate hook moves it out of the leaf's .grad as autograd makes it);
once the schedule has run, the layout change's backward steps -- the
reduce-scatter over the FSDP axis -- run once on the sum, which then flows
into the weight as the per-microbatch path's did (through the gradient
buckets where they reduce it on another axis). The steps are linear, so
reducing the sum is summing the reductions: the same gradient, scaled alike.
A checkpointed block (recompute.py) reads the held weight as one of its
region's inputs: the rewrite moves a weight's gather out of the region, so
forward and backward's rerun both read the held tensor (the checkpoint keeps a
reference to it, no copy) and its gradient reaches the held leaf as any other.

This is what torchtitan does with torch.distributed.pipelining and FSDP2:
`reshard_after_forward=False`, and `set_requires_gradient_sync` /
`set_is_last_backward` only for the last microbatch; FSDP2 too accumulates the
unsharded gradient in its reduce dtype. With reshard_after_forward True the
stage graphs gather (and reduce-scatter) per microbatch, as stages.py cuts them.

Every rank of an FSDP (or tensor-parallel) group holds the same stages, so the
gathers (in graph order) and the reductions (in the reverse order) come in
the same order on each. Every collective here is one of the layout change's
own steps (collectives.transform), logged as any other.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...capture.export import PARAM
from ...errors import PlanError
from ..collectives import transform
from ..lowering.recompute import CheckpointRegion
from ..lowering.rewrite import RedistributeModule, weight_gather

HELD = "held"   # the kind of a stage's input that takes a held weight: (HELD, the gathering node's name)


@dataclass(frozen=True)
class HeldGather:
    """One layout change of a weight that all-gathers it, run once per step instead of per microbatch."""
    node: str      # the local graph's node that calls it
    module: str    # the RedistributeModule it calls (a submodule of the local graph)
    source: tuple  # (PARAM, name) of the weight it gathers


def held_gathers(gm: fx.GraphModule, placeholders_of: dict) -> dict:
    """{node name: HeldGather} for each RedistributeModule call on a parameter placeholder that all-gathers it
    (on any axis; its other steps, casts and local cuts, run with it). `placeholders_of`: local placeholder
    name -> (kind, name). A checkpointed region takes such a gather's result as an input (rewrite moves it out
    of the region), so the region reads the held weight in forward and in its rerun alike."""
    is_param = {name for name, (kind, _) in placeholders_of.items() if kind == PARAM}
    out = {}
    for node in gm.graph.nodes:
        module = weight_gather(gm, node, is_param)
        if module is None:
            continue
        source = placeholders_of[node.args[0].name]
        if module.gathered is not None or module.group is not None:
            raise PlanError(f"weight {source[1]!r} is gathered again in backward ({module.label}) under a plan that "
                            "keeps weights whole (reshard_after_forward=False); the local graph was rewritten for "
                            "another plan: report this")
        out[node.name] = HeldGather(node.name, node.target, source)
    for node in gm.graph.nodes:   # a gather left in a region would run per microbatch, and again in the rerun
        region = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(region, CheckpointRegion) and any(
                weight_gather(region.body, n, is_param) is not None for n in region.body.graph.nodes):
            raise PlanError(f"checkpointed block {region.label} gathers a weight inside itself under a plan that "
                            "keeps weights whole (reshard_after_forward=False): the local graph was rewritten "
                            "for another plan: report this")
    return out


class HeldWeights:
    """This device's held gathers, in graph order, and during a step (`holding`) their whole values."""

    def __init__(self, gathers: list, root: torch.nn.Module):
        self.gathers = list(gathers)
        self._modules = [root.get_submodule(g.module) for g in self.gathers]
        self._held: dict = {}   # node -> _Held, while a step runs

    def __bool__(self) -> bool:
        return bool(self.gathers)

    def tensor(self, node: str) -> torch.Tensor:
        """The held whole weight a stage reads in place of gathering it (`node`: the gathering node)."""
        if node not in self._held:
            raise PlanError(f"a pipeline stage reads the held weight of {node!r} outside a train_step: the "
                            "weights are gathered only while ParallelModule.train_step runs its schedule")
        return self._held[node].leaf

    @contextmanager
    def holding(self, pm):
        """Gather every held weight once, run the body (the schedule), then reduce their summed gradients once,
        in the reverse order; the held tensors are freed on leaving, also when the body raised (then nothing
        is reduced). Enter it inside the buckets' accumulating() or through_autograd(): their routing is
        decided when a weight is read."""
        table = pm.weight_table()
        try:
            for g, module in zip(self.gathers, self._modules):
                (read,) = pm.grad_buckets.use([g.source[1]], [table[g.source]])
                self._held[g.node] = _gather(module, read)
            yield
            for g, module in zip(reversed(self.gathers), reversed(self._modules)):
                self._held[g.node].reduce(module)
        finally:
            for held in self._held.values():
                held.free()
            self._held.clear()


@dataclass(eq=False)
class _Held:
    """One held weight through a step."""
    read: torch.Tensor           # the weight as the gather read it (a bucket's view where they reduce it)
    leaf: torch.Tensor           # the whole weight the stages read
    reduce_dtype: torch.dtype    # what its gradient is summed and reduced in
    grad: torch.Tensor | None = None   # the microbatches' gradients so far, summed
    hook: object = None          # the leaf's post-accumulate hook: it holds this, which holds the leaf

    def free(self) -> None:
        """Drop the whole weight and its gradient now (the hook's reference cycle would wait for the GC)."""
        if self.hook is not None:
            self.hook.remove()
        self.leaf, self.grad, self.hook = None, None, None

    def add(self, leaf: torch.Tensor) -> None:
        """Post-accumulate hook: move the gradient autograd just accumulated into the sum."""
        g, leaf.grad = leaf.grad.to(self.reduce_dtype), None
        self.grad = g if self.grad is None else self.grad.add_(g)

    def reduce(self, module: RedistributeModule) -> None:
        """The layout change's backward on the summed gradient (Redistribute / CastAndRedistribute.backward:
        each step's gradient transform, last step first), handed on to the weight; autograd would cast the
        sum back to the compute dtype before those steps if it ran them."""
        if self.leaf.grad is not None:   # a zero-bubble weight pass writes .grad itself, past the hook
            self.add(self.leaf)
        if self.grad is None:
            return
        g = self.grad
        for s, whole in zip(reversed(module.steps), reversed(module.wholes)):
            g = transform(g, s.grad_dst, s.grad_src, s.axis, module.comm, "backward", whole)
        self.grad = None
        torch.autograd.backward(self.read, g.to(self.read.dtype))


def _gather(module: RedistributeModule, read: torch.Tensor) -> _Held:
    """The weight gathered whole (no autograd graph: its backward runs once, by hand, in _Held.reduce)."""
    with torch.no_grad():
        whole = module(read)
    leaf = whole.detach().requires_grad_(read.requires_grad)
    held = _Held(read, leaf, module.cast[1] if module.cast is not None else leaf.dtype)
    if leaf.requires_grad:
        held.hook = leaf.register_post_accumulate_grad_hook(held.add)
    return held
