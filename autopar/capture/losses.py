"""Losses the graph computes itself, rewritten so that neither a split batch nor a split
vocabulary needs gathered logits.

A mean over a split batch is not a sum of the ranks' means: with
`ignore_index` (padding, HF's -100 labels) each rank holds a different
number of counted targets. And a sum over positions hides which dim a
split came from: its scalar is a partial sum (P) whether the ranks held
different positions or different slices of the vocabulary, and the two
keep different tensors for backward. So every unweighted
`cross_entropy(x, t, reduction="mean" | "sum")` is rewritten at capture,
before any planning, into

    cross_entropy(x, t, reduction="none").sum()                  # "sum"
    cross_entropy(x, t, reduction="none").sum() / (t != ignore_index).sum()   # "mean"

-- the same number on one device. The per-position losses keep the
positions' dims: split positions stay split (S), a split vocabulary leaves
partial sums (P, runtime/lowering/vocab_parallel.py), and the sums and count are
reductions the sharding rules already split, reduced by scalar all-reduces
the cost model prices like any other. Class weights keep the op as it is,
whole over the classes (the weighted count needs the weights of every target).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._compat import fake_mode_of, op_schema

_CE = torch.ops.aten.cross_entropy_loss.default
_NONE, _MEAN, _SUM = 0, 1, 2   # torch's Reduction enum


def _bound_args(node: fx.Node) -> dict:
    """Every argument of the call by schema name, defaults filled in."""
    schema = op_schema(node.target)
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value
    return out


def split_losses(graph: fx.Graph) -> int:
    """Rewrite each unweighted mean or sum cross-entropy as above, in place; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CE:
            continue
        a = _bound_args(node)
        if a["reduction"] not in (_MEAN, _SUM) or a["weight"] is not None:
            continue
        x, t = a["self"], a["target"]
        xv, tv = x.meta["val"], t.meta["val"]
        keep_meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        with graph.inserting_before(node), fake_mode_of(xv):
            per = graph.call_function(_CE, (x, t, None, _NONE, a["ignore_index"], a["label_smoothing"]))
            per.meta = {**keep_meta, "val": _CE(xv, tv, None, _NONE, a["ignore_index"], a["label_smoothing"])}
            if a["reduction"] == _MEAN:
                total = graph.call_function(torch.ops.aten.sum.default, (per,))
                total.meta = {**keep_meta, "val": torch.ops.aten.sum.default(per.meta["val"])}
                counted = graph.call_function(torch.ops.aten.ne.Scalar, (t, a["ignore_index"]))
                counted.meta = {**keep_meta, "val": torch.ops.aten.ne.Scalar(tv, a["ignore_index"])}
                num = graph.call_function(torch.ops.aten.sum.default, (counted,), {"dtype": xv.dtype})
                num.meta = {**keep_meta, "val": torch.ops.aten.sum.default(counted.meta["val"], dtype=xv.dtype)}
        # the node itself becomes the last op: it keeps its name, so the export's output spec still names it
        if a["reduction"] == _MEAN:
            node.target, node.args, node.kwargs = torch.ops.aten.div.Tensor, (total, num), {}
        else:
            node.target, node.args, node.kwargs = torch.ops.aten.sum.default, (per,), {}
        count += 1
    if count:
        graph.lint()
    return count
