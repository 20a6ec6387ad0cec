"""Repeated blocks: layers that run the same computation on different weights.

A transformer is a stack (an nn.ModuleList) of identical layers, and the
best layout of one layer is the best layout of each: so the search gives
every repeat of a block the variables of its first copy, and its size stops
growing with depth. Blocks are found from module paths (`<stack>.<i>`, the
outermost numbered segment) and then checked on the graph: a repeat must be
the first copy's nodes in order, with the same ops, arguments, shapes and
dtypes, and the same wiring inside the block; a block is tied to the first
block of its stack that it repeats exactly, and one that repeats none keeps
variables of its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from .export import BUFFER, OP, PARAM, Captured

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    canonical: dict          # node of a repeat -> the same node of the stack's first block
    stacks: tuple            # (stack path, number of blocks in it) for stacks with some repeat


def block_of(path: str):
    """(stack path, block index) of a module or parameter path, from its outermost numbered segment."""
    m = _NUMBERED.match(path + ".") if path else None
    return (m.group(1), int(m.group(2))) if m else None


def _path(cap: Captured, node: fx.Node) -> str:
    info = cap.info[node.name]
    if info.kind == PARAM:
        return info.target_name or ""
    return info.module_path if info.kind == OP else ""


def node_signature(cap: Captured, node: fx.Node, members: dict, stack: str, index: int) -> tuple:
    """What must match for two nodes to share variables: everything but the block number.

    `members`: node name -> position in its block, for the nodes of block `index`.
    """
    info = cap.info[node.name]
    prefix = f"{stack}.{index}."

    def describe(a):
        if isinstance(a, fx.Node):
            return ("in", members[a.name]) if a.name in members else ("out",)
        return a

    args = fx.node.map_aggregate(node.args, describe)
    kwargs = fx.node.map_aggregate(node.kwargs, describe)
    metas = info.meta if isinstance(info.meta, list) else [info.meta]
    shapes = tuple((tuple(m.shape), m.dtype) if m is not None else None for m in metas)
    target = (info.target_name or "").replace(prefix, "", 1) if info.kind in (PARAM, BUFFER) else str(node.target)
    return (node.op, info.kind, target, repr(args), repr(kwargs), shapes)


def block_nodes(cap: Captured) -> dict:
    """Stack path -> {block index: [its nodes (parameters, then ops), in graph order]}."""
    groups: dict = {}
    for node in cap.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        key = block_of(_path(cap, node))
        if key is not None:
            groups.setdefault(key[0], {}).setdefault(key[1], []).append(node)
    return groups


def find_blocks(cap: Captured) -> Blocks:
    groups = block_nodes(cap)
    canonical, stacks = {}, []
    for stack, blocks in groups.items():
        firsts: dict = {}   # a block's signature -> the first block with it
        tied = 0
        for index, nodes in sorted(blocks.items()):
            members = {n.name: i for i, n in enumerate(nodes)}
            sig = tuple(node_signature(cap, n, members, stack, index) for n in nodes)
            first = firsts.setdefault(sig, nodes)
            if first is not nodes:
                canonical.update({n.name: f.name for n, f in zip(nodes, first)})
                tied += 1
        if tied:
            stacks.append((stack, tied + len(firsts)))
    return Blocks(canonical, tuple(stacks))
