"""The traced layers of a stack, read off the shallow graph repeat.py captures.

repeat.py traces a deep stack with only TRACED layers; this module finds which
graph nodes belong to which traced layer, checks that layers 1 and 2 are a true
repeat (same ops, shapes and wiring, names stepping by one layer), and renames
a node, a parameter or a module path from layer 2 to any later layer. Anything
that does not fit raises NotRepeated, and the model is captured whole.
"""
from __future__ import annotations

import dataclasses
import re

import torch.fx as fx

from .blocks import block_of, node_signature
from .export import BUFFER, OP, PARAM, Captured

TRACED = 3   # layers traced per stack: block 0 (may differ), 1 and 2 (a repeat and its wiring)


# how fx names a node: a base and an optional counter ("linear_12"), torch.fx.graph's _name_regex
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


_PLACEHOLDER_PREFIX = {PARAM: "p_", BUFFER: "b_"}


class NotRepeated(Exception):
    """The shallow graph does not show a repeat that copying can extend: capture whole.
    capture_repeated catches it; it never reaches the user."""


@dataclasses.dataclass(frozen=True)
class TracedLayers:
    """One stack's traced blocks in a graph."""
    blocks: tuple            # per traced block, its nodes (parameters, buffers, ops) in graph order
    where: dict              # node name -> (block, position in its block)
    ends: dict               # node name -> the section (PARAM / BUFFER / OP) it ends in the last layer
    last_op: str             # name of the stack's last op: nodes after it follow the stack


def section_of(cap: Captured, node: fx.Node) -> str | None:
    if node.op == "placeholder":
        kind = cap.info[node.name].kind
        return kind if kind in (PARAM, BUFFER) else None
    return OP if node.op != "output" else None


def _block(cap: Captured, node: fx.Node, stack: str) -> int | None:
    """Which block of `stack` a node belongs to: parameters and buffers by name, ops by module."""
    info = cap.info[node.name]
    path = info.target_name if node.op == "placeholder" else info.module_path
    key = block_of(path or "")
    if key is None or key[0] != stack:
        return None
    if node.op == "placeholder" and info.kind not in (PARAM, BUFFER):
        raise NotRepeated(f"{node.name}: a lifted constant in a layer")
    if node.op not in ("placeholder", "call_function"):
        raise NotRepeated(f"{node.name}: a {node.op} node in a layer (e.g. a higher-order op)")
    return key[1]


def traced_blocks(cap: Captured, stack: str) -> TracedLayers:
    """The traced blocks of `stack`, each one run of consecutive nodes per section, in order."""
    sections: dict = {}   # section -> [(block or None, node)] in graph order
    for node in cap.graph.nodes:
        section = section_of(cap, node)
        if section is not None:
            sections.setdefault(section, []).append((_block(cap, node, stack), node))
    blocks = [[] for _ in range(TRACED)]
    ends, last_op = {}, None
    for section, labelled in sections.items():
        indices = [b for b, _ in labelled]
        members = [i for i, b in enumerate(indices) if b is not None]
        if not members:
            continue
        run = indices[members[0]:members[-1] + 1]
        # consecutive (nothing between two layers) and in order 0, 1, 2
        if None in run or run != sorted(run) or set(run) != set(range(TRACED)):
            raise NotRepeated(f"the {section} nodes of {stack!r} are not one run per layer, in order")
        for b, node in labelled[members[0]:members[-1] + 1]:
            blocks[b].append(node)
        end = labelled[members[-1]][1].name
        ends[end] = section
        if section == OP:
            last_op = end
    if last_op is None:
        raise NotRepeated(f"no ops in {stack!r}")
    # a block's nodes in graph order: placeholders (parameters, then buffers), then ops
    order = {n.name: i for i, n in enumerate(cap.graph.nodes)}
    blocks = tuple(sorted(b, key=lambda n: order[n.name]) for b in blocks)
    where = {n.name: (b, j) for b, nodes in enumerate(blocks) for j, n in enumerate(nodes)}
    return TracedLayers(blocks, where, ends, last_op)


def _node_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes among a node's arguments, every occurrence, in order (all_input_nodes dedups)."""
    out = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def check_repeat(cap: Captured, stack: str, traced: TracedLayers) -> None:
    """Block 2 repeats block 1 op by op, and reads block 1 as block 1 reads block 0; nothing after
    the stack reads blocks 0 or 1. Raises NotRepeated otherwise."""
    _, one, two = traced.blocks
    if len(one) != len(two):
        raise NotRepeated(f"layers 1 and 2 of {stack!r} have {len(one)} and {len(two)} nodes")
    members = [{n.name: j for j, n in enumerate(b)} for b in traced.blocks]
    for a, b in zip(one, two):
        if node_signature(cap, a, members[1], stack, 1) != node_signature(cap, b, members[2], stack, 2):
            raise NotRepeated(f"{b.name} (layer 2 of {stack!r}) does not repeat {a.name} (layer 1)")
        for x1, x2 in zip(_node_inputs(a), _node_inputs(b)):
            if x2.name in members[2]:
                continue  # the signature compared positions inside the block
            if x2.name in members[1]:
                wired = members[0].get(x1.name) == members[1][x2.name]
            else:
                wired = x1 is x2 and x2.name not in members[0]
            if not wired:
                raise NotRepeated(f"{b.name} reads {x2.name}, which layer 1's {a.name} does not mirror")
    after = False
    for node in cap.graph.nodes:
        if after and any(x.name in members[0] or x.name in members[1] for x in node.all_input_nodes):
            raise NotRepeated(f"{node.name} follows {stack!r} but reads an early layer")
        after = after or node.name == traced.last_op


def split_name(name: str) -> tuple[str, int]:
    match = _NAME.match(name)
    if match is None:
        raise NotRepeated(f"{name!r} is not an fx node name")
    base, num = match.groups()
    return base, int(num or 0)


def _join_name(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


def name_strides(traced: TracedLayers) -> dict[str, int]:
    """Op name base -> how far its counter moves per layer.

    torch.export numbers ops per base in trace order (`linear`, `linear_1`, ...),
    so layer k's names are layer 2's moved on by (k - 2) strides, and the ops
    after the stack move on by the strides of the layers that were not traced.
    """
    strides: dict = {}
    for a, b in zip(traced.blocks[1], traced.blocks[2]):
        if b.op == "placeholder":
            continue
        (base, m1), (base2, m2) = split_name(a.name), split_name(b.name)
        if base != base2 or m2 <= m1 or strides.setdefault(base, m2 - m1) != m2 - m1:
            raise NotRepeated(f"names {a.name} and {b.name} do not step by one layer")
    return strides


def moved_name(name: str, strides: dict, layers: int) -> str:
    base, num = split_name(name)
    return _join_name(base, num + layers * strides[base]) if base in strides else name


def placeholder_name(kind: str, fqn: str) -> str:
    """torch.export's name for a parameter / buffer placeholder (placeholder_naming_pass)."""
    return _PLACEHOLDER_PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def renamed_block(path: str | None, stack: str, block: int) -> str | None:
    """A path or parameter name of layer 2 of `stack`, moved to layer `block`."""
    if path is None:
        return None
    head = f"{stack}.{TRACED - 1}"
    if path == head or path.startswith(head + "."):
        return f"{stack}.{block}" + path[len(head):]
    return path
