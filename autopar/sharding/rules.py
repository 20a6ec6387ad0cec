"""Sharding rules: one compact declaration per op.

A rule maps a node to an OpSpec: einsum-like letters for the dims of each
tensor input and of the output. From that alone strategies.py derives every
way to split the op over one mesh axis:
  - split a letter: every tensor holding it splits along that dim; a letter
    that vanishes from the output (a contraction) leaves partial sums (P);
  - feed partial sums through: for an op linear in input i, P in gives P out.
Letters in `no_shard` may never be split (a softmax dim, a normalized dim, a
dim a view cannot keep whole). Writing rules this way keeps each one a line
or two and makes them testable against the unsharded op.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from ..capture.export import TensorMeta


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple            # letters per tensor input (str), in tensor_args order
    output: str              # letters of the output (each output, for ops returning a tuple)
    no_shard: frozenset = frozenset()
    linear: tuple = ()       # inputs the op is linear in: one of them may be P (the rest R)
    additive: tuple = ()     # inputs added into the output: P whenever the output is P
    replicate_only: bool = False  # no strategy but all-R (factories, unknown ops)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order, duplicates kept (add(x, x) has two)."""
    out = []

    def visit(a):
        if isinstance(a, fx.Node):
            if _is_tensor_node(a):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
    visit(node.args)
    visit(node.kwargs)
    return out


def _is_tensor_node(n: fx.Node) -> bool:
    import torch
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], torch.Tensor))


class _Letters:
    """Hands out fresh dim letters."""
    def __init__(self):
        self.i = 0

    def __call__(self, k: int = 1) -> str:
        chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789αβγδεζηθικλμνξοπρστυφχψω"
        s = chars[self.i:self.i + k]
        self.i += k
        return s


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# ---------------------------------------------------------------- rule builders

def elementwise(node, ins: list[TensorMeta], out: TensorMeta, linear=(), additive=()) -> OpSpec:
    """Broadcasting elementwise op: input dims line up with output dims from the right."""
    new = _Letters()
    out_l = new(out.ndim)
    no_shard, in_l = set(), []
    for m in ins:
        s = ""
        for j in range(m.ndim):
            od = out.ndim - m.ndim + j
            if m.hint[j] == out.hint[od]:
                s += out_l[od]
            else:  # broadcast size-1 dim: it cannot be split
                c = new()
                no_shard.add(c)
                s += c
        in_l.append(s)
    # a Python scalar operand breaks linearity of add (P + c adds c on every rank)
    if additive and len(ins) < _num_operands(node):
        additive, linear = (), ()
    return OpSpec(tuple(in_l), out_l, frozenset(no_shard), tuple(linear), tuple(additive))


def _num_operands(node) -> int:
    return sum(1 for a in node.args[:2] if not isinstance(a, (str, type(None))))


def unary(linear: bool = False):
    def rule(node, ins, out):
        return elementwise(node, ins[:1], out, linear=(0,) if linear else ())
    return rule


def cast_rule(node, ins, out):
    """A cast is linear in its input only between floating types (rounding to ints is not)."""
    linear = ins[0].dtype.is_floating_point and out.dtype.is_floating_point
    spec = elementwise(node, ins[:1], out, linear=(0,) if linear else ())
    if len(ins) == 1:
        return spec
    # type_as(x, other): `other` only lends its dtype. Same shape: split it like x (no data
    # moves for it); otherwise keep it whole under letters of its own.
    if ins[1].hint == ins[0].hint:
        return OpSpec((spec.inputs[0], spec.inputs[0]), spec.output, spec.no_shard, spec.linear)
    # elementwise() hands out letters from "a" on, and a cast has far fewer than 26 dims
    own = "".join(chr(ord("A") + i) for i in range(ins[1].ndim))
    return OpSpec((spec.inputs[0], own), spec.output, spec.no_shard | frozenset(own), spec.linear)


def binary(kind: str):
    """kind: 'add' (both additive), 'mul' (linear in either), 'div' (linear in the first)."""
    def rule(node, ins, out):
        n = len(ins)
        if kind == "add":
            return elementwise(node, ins, out, additive=tuple(range(n)))
        if kind == "mul":
            return elementwise(node, ins, out, linear=tuple(range(n)))
        if kind == "div":
            return elementwise(node, ins, out, linear=(0,))
        return elementwise(node, ins, out)
    return rule


def linear_rule(node, ins, out):
    new = _Letters()
    batch = new(ins[0].ndim - 1)
    k, n = new(), new()
    inputs = [batch + k, n + k] + ([n] if len(ins) > 2 else [])
    return OpSpec(tuple(inputs), batch + n, linear=(0, 1), additive=(2,) if len(ins) > 2 else ())


def matmul_rule(node, ins, out):
    a, b = ins[0], ins[1]
    if a.ndim < 2 or b.ndim < 2:
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    new = _Letters()
    nb = out.ndim - 2
    batch = new(nb)
    m, k, n = new(), new(), new()
    no_shard, in_l = set(), []
    for t, tail in ((a, m + k), (b, k + n)):
        s = ""
        for j in range(t.ndim - 2):
            od = nb - (t.ndim - 2) + j
            if t.hint[j] == out.hint[od]:
                s += batch[od]
            else:
                c = new()
                no_shard.add(c)
                s += c
        in_l.append(s + tail)
    return OpSpec(tuple(in_l), batch + m + n, frozenset(no_shard), linear=(0, 1))


def addmm_rule(node, ins, out):
    new = _Letters()
    m, k, n = new(3)
    bias = ins[0]
    b = (m + n)[2 - bias.ndim:] if bias.ndim <= 2 else None
    if b is None or any(bias.hint[j] != out.hint[2 - bias.ndim + j] for j in range(bias.ndim)):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    return OpSpec((b, m + k, k + n), m + n, linear=(1, 2), additive=(0,))


def embedding_rule(node, ins, out):
    """A lookup is a one-hot matmul: splitting the vocab (v) leaves partial sums, as long as each
    rank looks up only its own rows (rewrite.local_target swaps in vocab_parallel_embedding)."""
    new = _Letters()
    v, d = new(), new()
    batch = new(ins[1].ndim)
    scale_grad_by_freq = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
    sparse = node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False)
    if scale_grad_by_freq or sparse:
        # dividing by each token's count in the batch needs every token (not a rank's shard of the
        # batch, nor its rows of the vocab); a sparse gradient has no masked vocab-parallel form
        return OpSpec(("", ""), "", replicate_only=True)
    return OpSpec((v + d, batch), batch + d)


def layer_norm_rule(node, ins, out):
    new = _Letters()
    normalized = len(node.args[1])
    x = new(ins[0].ndim)
    norm = x[ins[0].ndim - normalized:]
    return OpSpec((x,) + tuple(norm for _ in ins[1:]), x, frozenset(norm))


def keep_dim_rule(dim_arg: int = 1, linear: bool = False):
    """Same letters in and out, but the dim named by args[dim_arg] stays whole (softmax, cumsum)."""
    def rule(node, ins, out):
        new = _Letters()
        x = new(ins[0].ndim)
        d = _dim(node.args[dim_arg], ins[0].ndim)
        return OpSpec((x,), x, frozenset({x[d]}), linear=(0,) if linear else ())
    return rule


def sdpa_rule(node, ins, out):
    q, k, v = ins[:3]
    new = _Letters()
    nb = q.ndim - 2
    batch = new(nb)
    L, E, S, F = new(4)
    no_shard = {L, E, S, F}
    k_batch = ""
    for j in range(nb):
        if k.hint[j] == q.hint[j] and v.hint[j] == q.hint[j]:
            k_batch += batch[j]
        elif j == nb - 1 and k.hint[j] == v.hint[j] and q.hint[j] % k.hint[j] == 0:
            # GQA: splitting query heads and key/value heads alike keeps each query head with
            # its group's key/value head (needs both counts divisible, which the filter checks)
            k_batch += batch[j]
        else:
            c = new()
            no_shard.add(c)
            k_batch += c
    inputs = [batch + L + E, k_batch + S + E, k_batch + S + F]
    for m in ins[3:]:  # attention mask broadcasts against (batch..., L, S)
        full = batch + L + S
        s = ""
        for j in range(m.ndim):
            od = len(full) - m.ndim + j
            ref = (q.hint[:nb] + (q.hint[-2], k.hint[-2]))[od]
            if m.hint[j] == ref:
                s += full[od]
            else:
                c = new()
                no_shard.add(c)
                s += c
        inputs.append(s)
    return OpSpec(tuple(inputs), batch + L + F, frozenset(no_shard))


def view_rule(node, ins, out):
    """reshape/view: a split dim survives only as the first dim of its group."""
    new = _Letters()
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
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    d0, d1 = _dim(node.args[1], nd), _dim(node.args[2], nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return OpSpec((x,), "".join(x[p] for p in perm), linear=(0,))


def t_rule(node, ins, out):
    new = _Letters()
    x = new(ins[0].ndim)
    return OpSpec((x,), x[::-1], linear=(0,))


def permute_rule(node, ins, out):
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    return OpSpec((x,), "".join(x[_dim(p, nd)] for p in node.args[1]), linear=(0,))


def unsqueeze_rule(node, ins, out):
    new = _Letters()
    x = new(ins[0].ndim)
    d = _dim(node.args[1], out.ndim)
    c = new()
    return OpSpec((x,), x[:d] + c + x[d:], frozenset({c}), linear=(0,))


def squeeze_rule(node, ins, out):
    new = _Letters()
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
    new = _Letters()
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


def reduce_rule(kind: str):
    """sum (contraction: split reduced dims leave P) and mean (reduced dims stay whole)."""
    def rule(node, ins, out):
        new = _Letters()
        nd = ins[0].ndim
        x = new(nd)
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None or dims == []:
            dims = list(range(nd))
        elif isinstance(dims, int):
            dims = [dims]
        dims = {_dim(d, nd) for d in dims}
        keepdim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        o, no_shard = "", set()
        for i in range(nd):
            if i not in dims:
                o += x[i]
            elif keepdim:
                c = new(); no_shard.add(c); o += c
        if kind == "mean":
            no_shard |= {x[i] for i in dims}
        return OpSpec((x,), o, frozenset(no_shard), linear=(0,))
    return rule


def split_rule(node, ins, out):
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    return OpSpec((x,), x, frozenset({x[d]}), linear=(0,))


def getitem_rule(node, ins, out):
    new = _Letters()
    x = new(out.ndim)
    return OpSpec((x,), x, linear=(0,))


def cat_rule(node, ins, out):
    new = _Letters()
    x = new(out.ndim)
    d = _dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.ndim)
    if any(m.ndim != out.ndim for m in ins):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    return OpSpec(tuple(x for _ in ins), x, frozenset({x[d]}))


def slice_rule(node, ins, out):
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = _dim(node.args[1] if len(node.args) > 1 else 0, nd)
    whole = ins[0].hint[d] == out.hint[d]
    return OpSpec((x,), x, frozenset() if whole else frozenset({x[d]}), linear=(0,))


def select_rule(node, ins, out):
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    d = _dim(node.args[1], nd)
    return OpSpec((x,), x[:d] + x[d + 1:], frozenset({x[d]}), linear=(0,))


def diff_rule(node, ins, out):
    """diff(x, n, dim, prepend, append): neighbours along `dim`, so that dim stays whole."""
    new = _Letters()
    x = new(ins[0].ndim)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    d = _dim(dim, ins[0].ndim)
    return OpSpec(tuple(x for _ in ins), x, frozenset({x[d]}))


def index_rule(node, ins, out):
    """x[i0, i1, ...] with index tensors for the leading dims (no None gaps).

    The output is the index tensors' broadcast shape followed by x's other
    dims. Index tensors split like elementwise operands of that broadcast;
    x must be whole along the dims it is indexed on (any rank may need any
    row), and its other dims pass through.
    """
    indices = node.args[1]
    if any(i is None for i in indices) or len(ins) != 1 + len(indices):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    new = _Letters()
    x = ins[0]
    nb = out.ndim - (x.ndim - len(indices))
    out_l = new(out.ndim)
    no_shard = set()
    x_l = ""
    for d in range(x.ndim):
        if d < len(indices):
            c = new(); no_shard.add(c); x_l += c
        else:
            x_l += out_l[nb + d - len(indices)]
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


def last_two_whole(node, ins, out):
    """triu/tril: the pattern depends on positions in the last two dims."""
    new = _Letters()
    x = new(ins[0].ndim)
    return OpSpec((x,), x, frozenset(x[-2:]))


def cross_entropy_rule(node, ins, out):
    """cross_entropy(x[N, C, d...], t[N, d...], weight[C]?): classes whole (a softmax over them).

    reduction "none" is elementwise over N and d...; "sum" contracts them, so a split leaves
    partial sums. "mean" divides by a count no rank holds alone: it stays whole here, and
    losses.split_mean_losses rewrites the unweighted mean as sum / count at capture.
    """
    x = ins[0]
    new = _Letters()
    nd = x.ndim
    letters = new(nd)
    c = letters[1] if nd > 1 else letters[0]
    positions = letters[:1] + letters[2:] if nd > 1 else ""
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    inputs = [letters, positions] + [c for _ in ins[2:]]
    no_shard = {c}
    if reduction == 0:
        return OpSpec(tuple(inputs), positions, frozenset(no_shard))
    if reduction != 2:
        no_shard |= set(positions)
    return OpSpec(tuple(inputs), "", frozenset(no_shard))


def pad_rule(node, ins, out):
    """constant pad: padded dims change size and stay whole; the others pass through."""
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if op_name(node) == "aten.pad.default" and mode != "constant":
        return OpSpec(("",), "", replicate_only=True)
    new = _Letters()
    nd = ins[0].ndim
    x = new(nd)
    pads = node.args[1]
    padded = {x[nd - 1 - i // 2] for i, v in enumerate(pads) if v != 0}
    return OpSpec((x,), x, frozenset(padded))


def factory(node, ins, out):
    return OpSpec(tuple("" for _ in ins), "", replicate_only=True)


# ---------------------------------------------------------------- the table

Rule = Callable[[fx.Node, list, TensorMeta], OpSpec]

_UNARY = ["gelu", "relu", "silu", "tanh", "sigmoid", "exp", "log", "rsqrt", "sqrt", "abs",
          "pow.Tensor_Scalar", "dropout", "erf", "sin", "cos", "reciprocal", "square", "logical_not"]
_LINEAR_UNARY = ["neg", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "mul.Scalar", "div.Scalar"]
_CASTS = ["_to_copy", "to.dtype", "to.dtype_layout", "to.device"]

RULES: dict[str, Rule] = {}


def _register(names, rule, overloads=("default",)):
    for name in names:
        if "." in name:
            RULES[f"aten.{name}"] = rule
        else:
            for o in overloads:
                RULES[f"aten.{name}.{o}"] = rule


_register(_UNARY, unary())
_register(_LINEAR_UNARY, unary(linear=True))
_register(_CASTS, cast_rule)
RULES["aten.type_as.default"] = cast_rule
_register(["gelu_", "relu_"], unary())
RULES["aten.dropout.default"] = unary()
RULES["aten.add.Tensor"] = binary("add")
RULES["aten.sub.Tensor"] = binary("add")
RULES["aten.add.Scalar"] = binary("add")
RULES["aten.mul.Tensor"] = binary("mul")
RULES["aten.div.Tensor"] = binary("div")
for name in ["where.self", "masked_fill.Scalar", "masked_fill.Tensor", "maximum.default", "minimum.default",
             "eq.Tensor", "eq.Scalar", "ne.Scalar", "lt.Scalar", "gt.Scalar", "ge.Scalar", "le.Scalar",
             "pow.Tensor_Tensor", "le.Tensor", "lt.Tensor", "gt.Tensor", "ge.Tensor", "ne.Tensor",
             "__and__.Tensor", "__or__.Tensor", "bitwise_and.Tensor", "bitwise_or.Tensor",
             "logical_and.default", "logical_or.default"]:
    RULES[f"aten.{name}"] = binary("other")
RULES["aten.linear.default"] = linear_rule
for name in ["matmul.default", "mm.default", "bmm.default"]:
    RULES[f"aten.{name}"] = matmul_rule
RULES["aten.addmm.default"] = addmm_rule
RULES["aten.embedding.default"] = embedding_rule
RULES["aten.layer_norm.default"] = layer_norm_rule
for name in ["softmax.int", "_softmax.default", "log_softmax.int", "_log_softmax.default", "cumsum.default"]:
    RULES[f"aten.{name}"] = keep_dim_rule()
RULES["aten.scaled_dot_product_attention.default"] = sdpa_rule
for name in ["view.default", "reshape.default", "_unsafe_view.default", "flatten.using_ints"]:
    RULES[f"aten.{name}"] = view_rule
RULES["aten.transpose.int"] = transpose_rule
RULES["aten.t.default"] = t_rule
RULES["aten.permute.default"] = permute_rule
RULES["aten.unsqueeze.default"] = unsqueeze_rule
RULES["aten.squeeze.dim"] = squeeze_rule
RULES["aten.squeeze.dims"] = squeeze_rule
RULES["aten.squeeze.default"] = squeeze_rule
RULES["aten.expand.default"] = expand_rule
RULES["aten.sum.dim_IntList"] = reduce_rule("sum")
RULES["aten.sum.default"] = reduce_rule("sum")
RULES["aten.mean.dim"] = reduce_rule("mean")
RULES["aten.mean.default"] = reduce_rule("mean")
for name in ["split.Tensor", "split_with_sizes.default", "chunk.default"]:
    RULES[f"aten.{name}"] = split_rule
RULES["_operator.getitem"] = getitem_rule
RULES["aten.cat.default"] = cat_rule
RULES["aten.slice.Tensor"] = slice_rule
RULES["aten.select.int"] = select_rule
RULES["aten.index.Tensor"] = index_rule
RULES["aten.diff.default"] = diff_rule
RULES["aten.cross_entropy_loss.default"] = cross_entropy_rule
RULES["aten.pad.default"] = pad_rule
RULES["aten.constant_pad_nd.default"] = pad_rule
RULES["aten.triu.default"] = last_two_whole
RULES["aten.tril.default"] = last_two_whole
for name in ["arange.default", "arange.start", "arange.start_step", "zeros.default", "ones.default",
             "full.default", "empty.memory_format", "scalar_tensor.default", "zeros_like.default",
             "ones_like.default", "full_like.default", "empty_like.default", "randn.default", "rand.default",
             "new_ones.default", "new_zeros.default", "new_full.default", "new_empty.default"]:
    RULES[f"aten.{name}"] = factory


def op_name(node: fx.Node) -> str:
    """'aten.linear.default', '_operator.getitem', ... — the key into RULES."""
    t = node.target
    if t is operator.getitem:
        return "_operator.getitem"
    return str(t)


def rule_for(node: fx.Node) -> Rule | None:
    return RULES.get(op_name(node))
