"""Sharding rules: one compact declaration per op, and the table from aten op to rule.

The rules of ops that compute (elementwise, matmuls, norms, attention, reductions,
losses) are here; ops that only move dims are in layout_rules.py; the vocabulary both
are written in (OpSpec, letters) is op_spec.py, which also explains the formalism.
An op missing from RULES is replicated with an UnsupportedOpWarning.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .layout_rules import (cat_rule, diff_rule, expand_rule, getitem_rule, index_rule, pad_rule, permute_rule,
                           select_rule, slice_rule, split_rule, squeeze_rule, t_rule, transpose_rule, unbind_rule,
                           unsqueeze_rule, view_rule)
from ..capture.repeat_kv import repeated_heads
from .op_spec import Letters, OpSpec, Rule, elementwise, op_arg, op_name, tensor_args, wrap_dim
from .placement import dim_factor, shard_dim

SDPA = "aten.scaled_dot_product_attention.default"

# ---------------------------------------------------------------- rule builders


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
    new = Letters()
    batch = new(ins[0].ndim - 1)
    k, n = new(), new()
    inputs = [batch + k, n + k] + ([n] if len(ins) > 2 else [])
    return OpSpec(tuple(inputs), batch + n, linear=(0, 1), additive=(2,) if len(ins) > 2 else ())


def matmul_rule(node, ins, out):
    a, b = ins[0], ins[1]
    if a.ndim < 2 or b.ndim < 2:
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    new = Letters()
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
    new = Letters()
    m, k, n = new(3)
    bias = ins[0]
    b = (m + n)[2 - bias.ndim:] if bias.ndim <= 2 else None
    if b is None or any(bias.hint[j] != out.hint[2 - bias.ndim + j] for j in range(bias.ndim)):
        return OpSpec(tuple("" for _ in ins), "", replicate_only=True)
    return OpSpec((b, m + k, k + n), m + n, linear=(1, 2), additive=(0,))


def embedding_rule(node, ins, out):
    """A lookup is a one-hot matmul: splitting the vocab (v) leaves partial sums, as long as each
    rank looks up only its own rows (runtime/lowering/vocab_parallel.local_target swaps in vocab_parallel_embedding)."""
    new = Letters()
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
    new = Letters()
    normalized = len(node.args[1])
    x = new(ins[0].ndim)
    norm = x[ins[0].ndim - normalized:]
    return OpSpec((x,) + tuple(norm for _ in ins[1:]), x, frozenset(norm))


def keep_dim_rule(dim_arg: int = 1, linear: bool = False):
    """Same letters in and out, but the dim named by args[dim_arg] stays whole (softmax, cumsum)."""
    def rule(node, ins, out):
        new = Letters()
        x = new(ins[0].ndim)
        d = wrap_dim(node.args[dim_arg], ins[0].ndim)
        return OpSpec((x,), x, frozenset({x[d]}), linear=(0,) if linear else ())
    return rule


def sdpa_rule(node, ins, out):
    q, k, v = ins[:3]
    new = Letters()
    nb = q.ndim - 2
    batch = new(nb)
    L, E, S, F = new(4)
    # the query's rows (L) may split, keys and values staying whole (context parallelism: each rank attends
    # from its rows to every key). A causal op so split is right only at its rows' offset: the runtime
    # lowers it (runtime/lowering/context_parallel.py); the search allows it on context axes alone.
    no_shard = {E, S, F}
    if op_arg(node, 5, "is_causal", False) and q.hint[-2] != k.hint[-2]:
        no_shard.add(L)   # a causal mask over a query shorter than the keys: rows' offsets not derived here
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
    # ring attention: the rows and the keys split together, on one axis (ring_fits), the op passing keys
    # and values round it; without dropout (what the ring computes), for a causal op only where query and
    # keys are one sequence (its masks come from chunk positions). A mask must be boolean (an additive one
    # may be a learned bias, whose gradient the ring does not compute) with a row per query row: the ring
    # splits it with them and keeps its keys whole, reading each holder's columns in turn
    causal = op_arg(node, 5, "is_causal", False)
    mask_fits = len(ins) == 3 or (len(ins) == 4 and ins[3].dtype == torch.bool and ins[3].ndim >= 2
                                  and L in inputs[3])
    ring = (L, S) if (mask_fits and not op_arg(node, 4, "dropout_p", 0.0)
                      and not (causal and q.hint[-2] != k.hint[-2])) else ()
    return OpSpec(tuple(inputs), batch + L + F, frozenset(no_shard), ring=ring)


def reduce_rule(kind: str):
    """sum (contraction: split reduced dims leave P) and mean (reduced dims stay whole)."""
    def rule(node, ins, out):
        new = Letters()
        nd = ins[0].ndim
        x = new(nd)
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None or dims == []:
            dims = list(range(nd))
        elif isinstance(dims, int):
            dims = [dims]
        dims = {wrap_dim(d, nd) for d in dims}
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


def last_two_whole(node, ins, out):
    """triu/tril: the pattern depends on positions in the last two dims."""
    new = Letters()
    x = new(ins[0].ndim)
    return OpSpec((x,), x, frozenset(x[-2:]))


def cross_entropy_rule(node, ins, out):
    """cross_entropy(x[N, C, d...], t[N, d...], weight[C]?).

    reduction "none" is elementwise over N and d...; split classes (the vocabulary) leave
    partial sums: each rank's share of every position's loss, from its own slice of the
    logits and two all-reduces of a max and a sum per position inside the op
    (runtime/lowering/vocab_parallel.py, Megatron's vocab-parallel cross-entropy). "sum" and "mean"
    only reach here with class weights (capture/losses.py rewrites the unweighted ones as
    sums of "none"): the classes stay whole there, and so do the positions under "mean",
    which divides by a weighted count no rank holds alone.
    """
    x = ins[0]
    new = Letters()
    nd = x.ndim
    letters = new(nd)
    c = letters[1] if nd > 1 else letters[0]
    positions = letters[:1] + letters[2:] if nd > 1 else ""
    reduction = op_arg(node, 3, "reduction", 1)
    inputs = [letters, positions] + [c for _ in ins[2:]]
    weighted = len(ins) > 2
    if reduction == 0:
        return OpSpec(tuple(inputs), positions, frozenset({c}) if weighted or nd < 2 else frozenset())
    no_shard = {c} | (set(positions) if reduction != 2 else set())
    return OpSpec(tuple(inputs), "", frozenset(no_shard))


def vocab_split_axes(node, strategy, axis_sizes) -> tuple:
    """The mesh axes that split the classes (dim 1) of a cross-entropy's logits under `strategy`: the
    axes its local op all-reduces over (runtime/lowering/vocab_parallel.py); () for any other op or layout."""
    if op_name(node) != "aten.cross_entropy_loss.default" or strategy is None:
        return ()
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if shard_dim(p) == 1 and axis_sizes[a] > 1)


def ring_axes(node, strategy, axis_sizes) -> tuple:
    """The mesh axes on which attention `node` runs as a ring under `strategy` (its query's rows and its
    keys both split there: runtime/lowering/ring_attention.py); () for any other op or layout."""
    if op_name(node) != SDPA or strategy is None or len(strategy.inputs) < 2:
        return ()
    rows, keys = node.args[0].meta["val"].dim() - 2, node.args[1].meta["val"].dim() - 2
    return tuple(a for a, (q, k) in enumerate(zip(strategy.inputs[0], strategy.inputs[1]))
                 if shard_dim(q) == rows and shard_dim(k) == keys and axis_sizes[a] > 1)


def ring_fits(node, query_length: int, strategy, axis_sizes) -> bool:
    """A ring runs on one axis, which alone splits the rows and the keys; a causal one cuts its rows into
    two chunks per rank (the balanced layout), so it needs the sequence divisible by twice the axis.

    `query_length` is the example's length (the TensorMeta hint), never the traced SymInt: arithmetic on
    a SymInt dispatches to whatever proxy tracer is active, and on threaded ranks that may be another
    rank's capture."""
    axes = ring_axes(node, strategy, axis_sizes)
    if not axes:
        return True
    rows, keys = node.args[0].meta["val"].dim() - 2, node.args[1].meta["val"].dim() - 2
    (a,) = axes if len(axes) == 1 else (None,)
    if a is None or any(shard_dim(p) == rows for b, p in enumerate(strategy.inputs[0]) if b != a) \
            or any(shard_dim(p) == keys for b, p in enumerate(strategy.inputs[1]) if b != a):
        return False
    return not op_arg(node, 5, "is_causal", False) or query_length % (2 * axis_sizes[a]) == 0


def ring_repeats(node, cap, strategy, axis_sizes) -> int:
    """How many copies of each key/value head a ring attention's keys and values hold: GQA's repeat_kv before
    the op (capture/repeat_kv.py), whose copies the ring leaves out of what it passes round and keeps (it
    attends with enable_gqa instead). 1 where nothing is repeated, or where a rank's heads are not whole
    groups of copies (a heads split that the key/value heads do not divide)."""
    if not ring_axes(node, strategy, axis_sizes):
        return 1
    k, v = tensor_args(node)[1:3]
    heads = repeated_heads(k, cap)
    if heads is None or heads != repeated_heads(v, cap) or heads[0] != k.meta["val"].dim() - 3:
        return 1
    dim, groups, repeats = heads
    split = dim_factor(strategy.inputs[1], dim, axis_sizes)
    return repeats if groups % split == 0 and dim_factor(strategy.inputs[2], dim, axis_sizes) == split else 1


def causal_rows_split_axes(node, strategy, axis_sizes) -> tuple:
    """The mesh axes that split the query rows (dim -2) of a causal attention under `strategy`: such an op
    runs with its rows' global offset (runtime/lowering/context_parallel.py); () for any other op or layout."""
    if op_name(node) != SDPA or strategy is None:
        return ()
    if not op_arg(node, 5, "is_causal", False) or ring_axes(node, strategy, axis_sizes):
        return ()
    rows = node.args[0].meta["val"].dim() - 2
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if shard_dim(p) == rows and axis_sizes[a] > 1)


def factory(node, ins, out):
    return OpSpec(tuple("" for _ in ins), "", replicate_only=True)


# ---------------------------------------------------------------- the table

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
for name in ["where.self", "where.ScalarOther", "where.ScalarSelf", "masked_fill.Scalar", "masked_fill.Tensor",
             "maximum.default", "minimum.default",
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
RULES["aten.unbind.int"] = unbind_rule
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


def rule_for(node: fx.Node) -> Rule | None:
    return RULES.get(op_name(node))
