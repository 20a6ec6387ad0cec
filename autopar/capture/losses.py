"""Losses the graph computes itself, rewritten so a split batch needs no gathered logits.

A mean over a split batch is not a sum of the ranks' means: with
`ignore_index` (padding, HF's -100 labels) each rank holds a different
number of counted targets. So `cross_entropy(x, t, reduction="mean")` is
rewritten at capture, before any planning, into

    cross_entropy(x, t, reduction="sum") / (t != ignore_index).sum()

-- the same number on one device, and two reductions the sharding rules
already split: each rank's sum and count are partial sums (P) over the batch
axes, reduced by two scalar all-reduces that the cost model prices like any
other. The logits stay split along the batch. Class weights keep the op
whole (the weighted count would need the weights of every target).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._compat import fake_mode_of

_CE = torch.ops.aten.cross_entropy_loss.default
_MEAN, _SUM = 1, 2   # torch's Reduction enum


def _bound_args(node: fx.Node) -> dict:
    """Every argument of the call by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value
    return out


def split_mean_losses(graph: fx.Graph) -> int:
    """Rewrite each unweighted mean cross-entropy as sum / count, in place; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CE:
            continue
        a = _bound_args(node)
        if a["reduction"] != _MEAN or a["weight"] is not None:
            continue
        x, t = a["self"], a["target"]
        xv, tv = x.meta["val"], t.meta["val"]
        keep_meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        with graph.inserting_before(node), fake_mode_of(xv):
            total = graph.call_function(_CE, (x, t, None, _SUM, a["ignore_index"], a["label_smoothing"]))
            total.meta = {**keep_meta, "val": _CE(xv, tv, None, _SUM, a["ignore_index"], a["label_smoothing"])}
            counted = graph.call_function(torch.ops.aten.ne.Scalar, (t, a["ignore_index"]))
            counted.meta = {**keep_meta, "val": torch.ops.aten.ne.Scalar(tv, a["ignore_index"])}
            num = graph.call_function(torch.ops.aten.sum.default, (counted,), {"dtype": xv.dtype})
            num.meta = {**keep_meta, "val": torch.ops.aten.sum.default(counted.meta["val"], dtype=xv.dtype)}
        # the node itself becomes the division: it keeps its name, so the export's output spec still names it
        node.target, node.args, node.kwargs = torch.ops.aten.div.Tensor, (total, num), {}
        count += 1
    if count:
        graph.lint()
    return count
