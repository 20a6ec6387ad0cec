"""Liveness: which tensors are alive at each forward op.

Memory peaks at some op, not at the sum of everything a step makes: a
tensor lives from the op that makes it to the last op that reads it (the
module's outputs live to the end: the loss reads them). Tensors autograd
saves for backward are counted as activations (activations.py / terms.py);
the rest of what is alive at an op is transient working memory, and the
step's peak adds the largest such working set.

A view shares its base's storage, so it is not a tensor of its own here:
it keeps its base alive instead.
"""
from __future__ import annotations

from ..capture.export import OP, Captured
from .activations import storage_owners


def storage_owner(cap: Captured) -> dict[str, str]:
    """Node -> the node whose storage its output is (itself, unless it is a view).

    The same storage facts as the activation model's (activations.storage_owners,
    read off the traced tensors), so the two cannot disagree on what a view is.
    """
    owners = storage_owners(cap)
    out = {}
    for node in cap.graph.nodes:
        owner = owners.get((node.name, None)) or owners.get((node.name, 0))  # a tuple: its pieces' storage
        out[node.name] = owner[0] if owner else node.name
    return out


def live_sets(cap: Captured) -> list[tuple[str, tuple[str, ...]]]:
    """Per forward op, in order: (op, storage owners alive while it runs) -- ops' outputs only.

    Parameters and buffers live for the whole step and are counted with the
    parameters, so they are left out; so are user inputs, which the caller
    holds and which no memory term counts yet (unless autograd keeps them).
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
