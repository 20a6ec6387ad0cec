"""FSDP under a pipeline as practitioners run it: weights gathered once per step and held whole.

With `plan.reshard_after_forward` False on a pipelined plan, each FSDP weight
this device's stages read is all-gathered once per train_step, before the
schedule runs, and held whole while every microbatch runs; the stage graphs
read the held tensor instead of gathering it themselves. The held tensor is a
leaf of its own (`gathered.detach().requires_grad_()`), so autograd sums each
microbatch's gradient into its `.grad`, whole; once the schedule has run,
one backward from the gathered tensor with that sum runs the layout change's
backward -- the reduce-scatter over the FSDP axis, with the scaling the
per-microbatch path applies (it is linear, so reducing the sum is summing the
reductions) -- and the held tensors are dropped.

This is what torchtitan does with torch.distributed.pipelining and FSDP2:
`reshard_after_forward=False`, and `set_requires_gradient_sync` /
`set_is_last_backward` only for the last microbatch. With
reshard_after_forward True the stage graphs gather (and reduce-scatter) per
microbatch, as stages.py cuts them.

Every rank of an FSDP (or tensor-parallel) group holds the same stages, so the
gathers (in graph order) and the reductions (in the reverse order) come in
the same order on each: every collective here is launched by the layout
change's own RedistributeModule, logged as any other.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...capture.export import PARAM
from ...errors import PlanError
from ...sharding.redistribute import gathers_again
from ..lowering.rewrite import RedistributeModule

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
    name -> (kind, name)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), RedistributeModule):
            continue
        (src,) = node.args
        source = placeholders_of.get(src.name) if src.op == "placeholder" else None
        module = gm.get_submodule(node.target)
        if source is None or source[0] != PARAM or not gathers_again(module.steps, is_param=True):
            continue
        if module.gathered is not None or module.group is not None:
            raise PlanError(f"weight {source[1]!r} is gathered again in backward ({module.label}) under a plan that "
                            "keeps weights whole (reshard_after_forward=False); the local graph was rewritten for "
                            "another plan: report this")
        out[node.name] = HeldGather(node.name, node.target, source)
    return out


class HeldWeights:
    """This device's held gathers, in graph order, and during a step (`holding`) their whole values."""

    def __init__(self, gathers: list, root: torch.nn.Module):
        self.gathers = list(gathers)
        self._modules = [root.get_submodule(g.module) for g in self.gathers]
        self._whole: dict = {}   # node -> (the gathered tensor, with its autograd graph; the leaf stages read)

    def __bool__(self) -> bool:
        return bool(self.gathers)

    def tensor(self, node: str) -> torch.Tensor:
        """The held whole weight a stage reads in place of gathering it (`node`: the gathering node)."""
        if node not in self._whole:
            raise PlanError(f"a pipeline stage reads the held weight of {node!r} outside a train_step: the "
                            "weights are gathered only while ParallelModule.train_step runs its schedule")
        return self._whole[node][1]

    @contextmanager
    def holding(self, pm):
        """Gather every held weight once (through the gradient buckets where they reduce it on another axis),
        run the body (the schedule), then reduce their summed gradients once, in the reverse order; the held
        tensors are freed on leaving, also when the body raised (then nothing is reduced). Enter it inside
        the buckets' accumulating() or through_autograd(): their routing is decided when a weight is read."""
        table = pm.weight_table()
        try:
            for g, module in zip(self.gathers, self._modules):
                (w,) = pm.grad_buckets.use([g.source[1]], [table[g.source]])
                whole = module(w)
                self._whole[g.node] = (whole, whole.detach().requires_grad_(whole.requires_grad))
            yield
            self._reduce()
        finally:
            self._whole.clear()

    def _reduce(self) -> None:
        """One backward per held weight, from the gathered tensor with its leaf's summed gradient: the
        reduce-scatter (and whatever else the layout change's backward does) once per step."""
        for g in reversed(self.gathers):
            whole, leaf = self._whole[g.node]
            if leaf.grad is not None:
                torch.autograd.backward(whole, leaf.grad)
            leaf.grad = None
