"""GQA's repeat_kv as a captured graph has it: key/value heads repeated to the query's before attention.

Hugging Face's Llama-family attention calls `repeat_kv` (unsqueeze, expand, reshape) on its keys and values,
so the captured SDPA takes as many key/value heads as query heads. The pattern is read here, once, for those
that care what is a repeat: the activation model (what the merge keeps) and ring attention, which passes the
distinct heads round rather than their copies (sharding/rules.ring_repeats).
"""
from __future__ import annotations

from torch import fx

from .._compat import operator_name
from .export import Captured

_SLICE, _EXPAND, _UNSQUEEZE = "aten.slice.Tensor", "aten.expand.default", "aten.unsqueeze.default"
_MERGES = ("aten.reshape.default", "aten.flatten.using_ints")


def _meta(cap: Captured, node: fx.Node):
    m = cap.info[node.name].meta
    return m[0] if isinstance(m, list) else m


def through_whole_slices(node, cap: Captured):
    """The tensor behind slices that keep every element (x[:, :, None] traced with a dynamic dim
    slices each dim from 0 to its size; a static trace drops such slices)."""
    while isinstance(node, fx.Node) and operator_name(node.target) == _SLICE and isinstance(node.args[0], fx.Node):
        src, out = _meta(cap, node.args[0]), _meta(cap, node)
        if src is None or out is None or src.shape != out.shape:
            break
        node = node.args[0]
    return node


def repeated_heads(node: fx.Node, cap: Captured) -> tuple | None:
    """(dim, groups, repeats) if `node` is GQA's repeat_kv: reshape(expand(unsqueeze(x, j))) merging x's
    dim j-1 (its `groups` key/value heads) with `repeats` copies of each, so that head h of the result is
    copy h % repeats of x's head h // repeats."""
    if not isinstance(node, fx.Node) or operator_name(node.target) not in _MERGES or not node.args:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or operator_name(expand.target) != _EXPAND:
        return None
    unsq = through_whole_slices(expand.args[0], cap)
    if not isinstance(unsq, fx.Node) or operator_name(unsq.target) != _UNSQUEEZE or \
            not isinstance(unsq.args[0], fx.Node):
        return None
    x = _meta(cap, through_whole_slices(unsq.args[0], cap))
    e, out = _meta(cap, expand), _meta(cap, node)
    if x is None or e is None or out is None:
        return None
    j = unsq.args[1] % e.ndim
    if j == 0:
        return None
    repeats, groups = e.hint[j], x.hint[j - 1]
    merged = x.hint[:j - 1] + (groups * repeats,) + x.hint[j:]
    return (j - 1, groups, repeats) if out.hint == merged and repeats > 1 else None
