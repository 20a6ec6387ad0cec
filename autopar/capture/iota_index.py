"""Indexing with a count along the batch, rewritten as a plain slice.

Hugging Face builds the padding part of its attention mask as
`padding_mask[batch_idx, kv_idx]` (transformers' masking_utils), where
`batch_idx = arange(batch)[:, None, None, None]` merely counts the rows:
row b of the result reads row b of the mask. As written, that is a gather
along the batch dim, which no split of the batch can run locally (any rank
may read any row), so a padded batch would force the mask -- and with it the
batch -- whole on every rank.

Counting the rows is taking all of them. So at capture, before anything reads
the graph, every `x[arange(n).view(n, 1, ..., 1), J, ...]` whose other index
tensors do not vary along that first dim is rewritten into the same numbers as

    x[:, J', ...]        (aten.index with None for dim 0; J' is J without its leading 1)

whose dim 0 passes through from x, so it splits like x does (layout_rules.index_rule).
The two agree only where n equals x's size along dim 0, so that must hold at every
size the module takes, not just the example's: the sizes are compared as symbols.
A (16, 16) table read as `table[i[:, None], i[None, :]]` with `i = arange(seq)` is
left alone although an example of seq 16 matches the table (at seq 12 the original
reads a 12 x 12 corner; the rewrite would read 16 rows). HF's mask and count come
from different inputs (attention_mask's batch and input_ids'), which export gives
different symbols: the capture passes `rename`, under which the dims the module
checks are equal at every call (export.py's `_dim_symbols`) are one symbol.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from .._compat import fake_mode_of, symint_expr

_INDEX = torch.ops.aten.index.Tensor
_ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
_UNSQUEEZE = torch.ops.aten.unsqueeze.default
_SQUEEZE = torch.ops.aten.squeeze.dim
_FULL_SLICE_END = 2**63 - 1


def _counts_rows(node, num_rows, same) -> bool:
    """Whether `node` is arange(num_rows) (from 0, step 1; `same` compares sizes), shaped (num_rows, 1, ..., 1)
    by unsqueezes and whole-length slices."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is _UNSQUEEZE or node.target is torch.ops.aten.slice.Tensor and _whole_slice(node):
            node = node.args[0]
            continue
        if node.target in _ARANGE:
            start, step = _arange_start_step(node)
            val = node.meta.get("val")
            return start == 0 and step == 1 and val is not None and val.dim() == 1 and same(val.shape[0], num_rows)
        return False
    return False


def _whole_slice(node: fx.Node) -> bool:
    args = list(node.args) + [None] * (4 - len(node.args))
    start, end = args[2], args[3]
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (None, 0) and end in (None, _FULL_SLICE_END) and step == 1


def _arange_start_step(node: fx.Node) -> tuple:
    if node.target is torch.ops.aten.arange.default:
        return 0, 1
    start = node.args[0]
    step = node.args[2] if node.target is torch.ops.aten.arange.start_step and len(node.args) > 2 else 1
    return start, step


def _expr(size) -> sympy.Expr:
    return symint_expr(size) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _same_size(rename: dict):
    """Whether two sizes (ints or SymInts) are one expression once export's symbols are renamed by `rename`:
    equal at every size the module takes, not only at the example's (where any two sizes may meet)."""
    def same(a, b) -> bool:
        return _expr(a).xreplace(rename) == _expr(b).xreplace(rename)
    return same


def _shape_is_column(val, same) -> bool:
    """(n, 1, ..., 1): varies along dim 0 only."""
    return val is not None and val.dim() >= 1 and all(same(s, 1) for s in val.shape[1:])


def rewrite_row_counts(graph: fx.Graph, rename: dict | None = None) -> int:
    """Rewrite each index by a row count as above, in place; returns how many.

    `rename`: export's size symbols -> symbols under which sizes the module checks are equal at every call
    are one (by default each symbol is its own)."""
    same = _same_size(rename or {})
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _INDEX:
            continue
        x, indices = node.args[0], list(node.args[1])
        if len(indices) < 2 or any(i is None for i in indices):
            continue
        rows, rest = indices[0], indices[1:]
        xv, rows_val = x.meta.get("val"), rows.meta.get("val")
        if xv is None or not _shape_is_column(rows_val, same) or not _counts_rows(rows, xv.shape[0], same):
            continue
        rank = rows_val.dim()
        rest_vals = [j.meta.get("val") for j in rest]
        # the other indices must not vary along the first dim: rank below the count's, or a leading 1
        if any(v is None or v.dim() > rank or (v.dim() == rank and not same(v.shape[0], 1)) for v in rest_vals):
            continue
        new_rest = []
        with graph.inserting_before(node), fake_mode_of(xv):
            for j, v in zip(rest, rest_vals):
                if v.dim() == rank:      # drop the leading 1
                    j = _call(graph, _SQUEEZE, (j, 0), j)
                else:                    # pad to rank - 1 dims, as broadcasting against the count did
                    for _ in range(rank - 1 - v.dim()):
                        j = _call(graph, _UNSQUEEZE, (j, 0), j)
                new_rest.append(j)
        node.args = (x, [None, *new_rest])
        _erase_unused(rows)
        count += 1
    if count:
        graph.lint()
    return count


def _erase_unused(node) -> None:
    """Erase `node` and then its inputs while nothing else uses them (the count no index reads now)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None


def _call(graph: fx.Graph, target, args: tuple, like: fx.Node) -> fx.Node:
    """A new node `target(*args)` with its example value, and the module path of `like`."""
    new = graph.call_function(target, args)
    vals = tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in args)
    new.meta = {k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace")}
    new.meta["val"] = target(*vals)
    return new
