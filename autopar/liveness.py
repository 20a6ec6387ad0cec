"""Liveness: which tensors are alive at each forward op.

Memory peaks at some op, not at the sum of everything a step makes: a
tensor lives from the op that makes it to the last op that reads it (the
module's outputs live to the end: the loss reads them). Tensors autograd
saves for backward are counted as activations (activations.py / cost.py);
the rest of what is alive at an op is transient working memory, and the
step's peak adds the largest such working set.

A view shares its base's storage, so it is not a tensor of its own here:
it keeps its base alive instead.
"""
from __future__ import annotations

import operator

from .capture import OP, Captured
from .rules import op_name

VIEW_OPS = {
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int",
    "aten.permute.default", "aten.t.default", "aten.expand.default", "aten.unsqueeze.default",
    "aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.slice.Tensor", "aten.select.int",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.alias.default", "aten.detach.default",
    "aten.unflatten.int", "aten.flatten.using_ints", "aten.chunk.default", "aten.unbind.int",
}


def storage_owner(cap: Captured) -> dict[str, str]:
    """Node -> the node whose storage its output is (itself, unless it is a view)."""
    owner = {}
    for node in cap.graph.nodes:
        base = node
        if node.op == "call_function" and (node.target is operator.getitem or op_name(node) in VIEW_OPS):
            src = node.args[0]
            base = cap.node(owner.get(src.name, src.name)) if hasattr(src, "name") else node
        owner[node.name] = base.name
    return owner


def live_sets(cap: Captured) -> list[tuple[str, tuple[str, ...]]]:
    """Per forward op, in order: (op, storage owners alive while it runs) -- ops' outputs only.

    Parameters, buffers and user inputs live for the whole step and are
    counted elsewhere, so they are left out.
    """
    owner = storage_owner(cap)
    order = [n for n in cap.graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(order)}
    last_use: dict[str, int] = {}
    for node in cap.graph.nodes:
        for a in node.all_input_nodes:
            o = owner.get(a.name, a.name)
            if o not in position or cap.info[o].kind != OP or cap.info[o].meta is None:
                continue
            when = len(order) if node.op == "output" else position[node.name]
            last_use[o] = max(last_use.get(o, position[o]), when)
    out, alive = [], []
    for i, node in enumerate(order):
        if owner[node.name] == node.name and cap.info[node.name].meta is not None:
            alive.append(node.name)
        alive = [o for o in alive if last_use.get(o, position[o]) >= i]
        out.append((node.name, tuple(alive)))
    return out
