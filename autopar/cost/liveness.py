"""Liveness: which tensors are alive at each forward op.

Memory peaks at some op, not at the sum of everything a step makes: a
tensor lives from the op that makes it to the last op that reads it (the
module's outputs live to the end: the loss reads them). Tensors autograd
saves for backward are counted as activations (activations.py / terms.py);
the rest of what is alive at an op is transient working memory, and the
step's peak adds the largest such working set.

A view shares its base's storage, so it is not a tensor of its own here:
it keeps its base alive instead.

Backward starts with every saved activation still alive, and adds to them
the outputs' gradients and the gradients the op that made an output computes
for its inputs (for a GPT's head: the logits' gradient, the head weight's
whole gradient before a bucket or reduce-scatter takes it, and the last
hidden state's gradient). That is a working set of its own (backward_start),
which for a large vocabulary is larger than any forward op's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..capture.export import OP, Captured
from ..sharding.op_spec import tensor_args
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


@dataclass(frozen=True)
class BackwardStart:
    """Where the gradients backward holds as it starts come from, by tensor-argument position.

    `graded`: the positions among the output node's tensor arguments of the outputs that get a gradient
    (priced in the layout the module returns them in). `heads`: for each op whose storage an output is,
    the positions of its tensor inputs it computes a gradient for (priced as the op reads them: a weight
    an FSDP rank gathers gets a whole gradient). Backward runs one head at a time.
    """
    output: str
    graded: tuple[int, ...]
    heads: tuple[tuple[str, tuple[int, ...]], ...]


def backward_start(cap: Captured, grad_nodes: set) -> BackwardStart:
    out_node = next(n for n in cap.graph.nodes if n.op == "output")
    owner = storage_owner(cap)
    args = tensor_args(out_node)
    graded = tuple(i for i, a in enumerate(args) if a.name in grad_nodes)
    heads = {}
    for i in graded:
        head = owner.get(args[i].name, args[i].name)
        if head not in heads and cap.info[head].kind == OP:
            heads[head] = tuple(j for j, a in enumerate(tensor_args(cap.node(head))) if a.name in grad_nodes)
    return BackwardStart(out_node.name, graded, tuple(heads.items()))
