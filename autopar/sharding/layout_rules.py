"""Sharding rules of the ops that move, cut or join dims without computing on them: views,
transposes, squeezes, expands, splits and cats, slices and selects, indexing, padding.

Their one question is which input dim each output dim is (a split dim must stay the
first of its group through a reshape); rules.py holds the ops that compute and the table.
"""
from __future__ import annotations

from .op_spec import Letters, OpSpec, op_name, wrap_dim


def view_rule(node, ins, out):
    """reshape/view: a split dim survives only as the first dim of its group."""
    new = Letters()
    a, b = ins[0].hint, out.hint
    in_l, out_l, no_shard = [None] * len(a), [None] * len(b), set()
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            in_l[i] = c = new(); no_shard.add(c); i += 1; continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            out_l[j] = c = new(); no_shard.add(c); j += 1; continue
        if i >= len(a) or j >= len(b):
            return OpSpec(("",), "", replicate_only=True)
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        while pa != pb:
            if pa < pb:
                i += 1; gi.append(i); pa *= a[i]
            else:
                j += 1; gj.append(j); pb *= b[j]
        shared = new()
        in_l[gi[0]], out_l[gj[0]] = shared, shared
        for x in gi[1:]:
            in_l[x] = c = new(); no_shard.add(c)
        for x in gj[1:]:
            out_l[x] = c = new(); no_shard.add(c)
        i, j = i + 1, j + 1
    return OpSpec(("".join(in_l),), "".join(out_l), frozenset(no_shard), linear=(0,))


def transpose_rule(node, ins, out):
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    d0, d1 = wrap_dim(node.args[1], nd), wrap_dim(node.args[2], nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return OpSpec((x,), "".join(x[p] for p in perm), linear=(0,))


def t_rule(node, ins, out):
    new = Letters()
    x = new(ins[0].ndim)
    return OpSpec((x,), x[::-1], linear=(0,))


def permute_rule(node, ins, out):
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    return OpSpec((x,), "".join(x[wrap_dim(p, nd)] for p in node.args[1]), linear=(0,))


def unsqueeze_rule(node, ins, out):
    new = Letters()
    x = new(ins[0].ndim)
    d = wrap_dim(node.args[1], out.ndim)
    c = new()
    return OpSpec((x,), x[:d] + c + x[d:], frozenset({c}), linear=(0,))


def squeeze_rule(node, ins, out):
    new = Letters()
    x = new(ins[0].ndim)
    kept = _match_kept_dims(ins[0].hint, out.hint)
    if kept is None:
        return OpSpec((x,), "", replicate_only=True)
    dropped = {x[i] for i in range(len(x)) if i not in kept}
    return OpSpec((x,), "".join(x[i] for i in kept), frozenset(dropped), linear=(0,))


def _match_kept_dims(a, b):
    kept, j = [], 0
    for i, s in enumerate(a):
        if j < len(b) and s == b[j]:
            kept.append(i); j += 1
        elif s != 1:
            return None
    return kept if j == len(b) else None


def expand_rule(node, ins, out):
    new = Letters()
    out_l = new(out.ndim)
    m = ins[0]
    s, no_shard = "", set()
    for j in range(m.ndim):
        od = out.ndim - m.ndim + j
        if m.hint[j] == out.hint[od]:
            s += out_l[od]
        else:
            c = new(); no_shard.add(c); s += c
            no_shard.add(out_l[od])
    for od in range(out.ndim - m.ndim):
        no_shard.add(out_l[od])
    return OpSpec((s,), out_l, frozenset(no_shard), linear=(0,))


def split_rule(node, ins, out):
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = wrap_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    return OpSpec((x,), x, frozenset({x[d]}), linear=(0,))


def getitem_rule(node, ins, out):
    new = Letters()
    x = new(out.ndim)
    return OpSpec((x,), x, linear=(0,))


def cat_rule(node, ins, out):
    new = Letters()
    x = new(out.ndim)
    d = wrap_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.ndim)
    if any(m.ndim != out.ndim for m in ins):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    return OpSpec(tuple(x for _ in ins), x, frozenset({x[d]}))


def slice_rule(node, ins, out):
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = wrap_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    whole = ins[0].hint[d] == out.hint[d]
    return OpSpec((x,), x, frozenset() if whole else frozenset({x[d]}), linear=(0,))


def select_rule(node, ins, out):
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = wrap_dim(node.args[1], nd)
    return OpSpec((x,), x[:d] + x[d + 1:], frozenset({x[d]}), linear=(0,))


def unbind_rule(node, ins, out):
    """unbind(x, dim): the slices along `dim` (a fused qkv's q, k and v), each without that dim; any other
    dim may split."""
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = wrap_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), nd)
    return OpSpec((x,), x[:d] + x[d + 1:], frozenset({x[d]}), linear=(0,))


def diff_rule(node, ins, out):
    """diff(x, n, dim, prepend, append): neighbours along `dim`, so that dim stays whole."""
    new = Letters()
    x = new(ins[0].ndim)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    d = wrap_dim(dim, ins[0].ndim)
    return OpSpec(tuple(x for _ in ins), x, frozenset({x[d]}))


def index_rule(node, ins, out):
    """x[:, ..., i0, i1, ...]: index tensors for adjacent dims, after leading whole dims (None in aten).

    The output is x's leading dims, then the index tensors' broadcast shape,
    then x's other dims. Index tensors split like elementwise operands of that
    broadcast; x must be whole along the dims it is indexed on (any rank may
    need any row); its leading and trailing dims pass through.
    """
    indices = list(node.args[1])
    lead = next((k for k, i in enumerate(indices) if i is not None), len(indices))
    advanced = indices[lead:]
    if not advanced or any(i is None for i in advanced) or len(ins) != 1 + len(advanced):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    new = Letters()
    x = ins[0]
    nb = out.ndim - (x.ndim - lead - len(advanced))   # the leading dims and the broadcast shape
    out_l = new(out.ndim)
    no_shard = set()
    x_l = ""
    for d in range(x.ndim):
        if d < lead:
            x_l += out_l[d]
        elif d < lead + len(advanced):
            c = new(); no_shard.add(c); x_l += c
        else:
            x_l += out_l[nb + d - lead - len(advanced)]
    idx_l = []
    for m in ins[1:]:
        s = ""
        for j in range(m.ndim):
            od = nb - m.ndim + j
            if m.hint[j] == out.hint[od]:
                s += out_l[od]
            else:
                c = new(); no_shard.add(c); s += c
        idx_l.append(s)
    return OpSpec((x_l,) + tuple(idx_l), out_l, frozenset(no_shard))


def pad_rule(node, ins, out):
    """constant pad: padded dims change size and stay whole; the others pass through."""
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if op_name(node) == "aten.pad.default" and mode != "constant":
        return OpSpec(("",), "", replicate_only=True)
    new = Letters()
    nd = ins[0].ndim
    x = new(nd)
    pads = node.args[1]
    padded = {x[nd - 1 - i // 2] for i, v in enumerate(pads) if v != 0}
    return OpSpec((x,), x, frozenset(padded))
