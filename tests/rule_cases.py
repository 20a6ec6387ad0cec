"""One tiny program per sharding rule, for the property test in test_rules.py.

A Case names the op keys of `autopar.sharding.rules.RULES` it covers and a hypothesis
strategy that draws a program: `(module, example_inputs)`. Every draw must
emit every op the case claims when captured (test_rules checks that, so a
case cannot silently stop testing its op), and may emit other ops too (only
the claimed ones are checked). Inputs are float64 where the op allows, so the
comparison with the unsharded op is not drowned in rounding noise.

Most ops come from ordinary high-level code. The training IR of this torch
version never emits a few of them from such code (`add.Scalar`, `mul.Scalar`,
`div.Scalar`, `_to_copy`, `_softmax`, `_log_softmax`, `_unsafe_view`,
`gelu_`, `addmm`, `alias`): the cases call those through `torch.ops.aten`
inside `forward`, which torch.export records as they are, so every case still
goes through `autopar.capture.export.capture` like a real model does.
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

aten = torch.ops.aten
DT = torch.float64
SIZES = st.sampled_from([1, 2, 3, 4, 6, 8])     # 4 and 8 reach nested splits on a 2x2 mesh
INT_MAX = 9223372036854775807


class Case:
    def __init__(self, name: str, ops: frozenset, program: st.SearchStrategy):
        self.name = name
        self.ops = ops            # RULES keys this case covers
        self.program = program    # draws (module, example_inputs)

    def __repr__(self):
        return self.name


CASES: list[Case] = []


def case(*ops):
    def deco(fn):
        CASES.append(Case(fn.__name__, frozenset(ops), st.composite(fn)()))
        return fn
    return deco


class Fn(nn.Module):
    """forward(*xs) = fn(self, *xs); submodules (parameters) passed by keyword."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for k, m in modules.items():
            setattr(self, k, m)

    def forward(self, *xs):
        return self.fn(self, *xs)


# ---------------------------------------------------------------- drawing helpers

def seeded(draw):
    torch.manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))


def shape(draw, lo=1, hi=3, sizes=SIZES):
    return tuple(draw(st.lists(sizes, min_size=lo, max_size=hi)))


def randn(shp):
    return torch.randn(shp, dtype=DT)


def ints_as_float(shp, lo=-2, hi=3):
    """Small integers as floats: comparisons and maximum hit ties."""
    return torch.randint(lo, hi, shp).to(DT)


def broadcast_operand(draw, full):
    """A shape that broadcasts to `full`: a suffix of it with some dims set to 1."""
    k = draw(st.integers(0, len(full)))
    out = []
    for s in full[len(full) - k:]:
        out.append(1 if draw(st.booleans()) else s)
    return tuple(out)


def dim_of(draw, ndim):
    """A dim index, negative half of the time."""
    d = draw(st.integers(0, ndim - 1))
    return d - ndim if draw(st.booleans()) else d


def regroup(draw, shp):
    """A shape with the same numel as `shp`, by merging and splitting its prime factors.

    The factors of each dim are shuffled and the whole ordered list is cut into
    consecutive groups, so the result reaches merges ((4,6)->(24)), splits
    ((24)->(4,6)) and irregular regroupings ((6,4)->(3,8)); size-1 dims are
    dropped or inserted at random.
    """
    factors = []
    for s in shp:
        f = _primes(s)
        factors += draw(st.permutations(f)) if f else []
    out, cur = [], 1
    for i, f in enumerate(factors):
        cur *= f
        if i == len(factors) - 1 or draw(st.booleans()):
            out.append(cur)
            cur = 1
    for _ in range(draw(st.integers(0, 2))):
        out.insert(draw(st.integers(0, len(out))), 1)
    return tuple(out)


def _primes(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


# ---------------------------------------------------------------- elementwise

@case("aten.gelu.default", "aten.relu.default", "aten.silu.default", "aten.tanh.default",
      "aten.sigmoid.default", "aten.exp.default", "aten.log.default", "aten.rsqrt.default",
      "aten.sqrt.default", "aten.abs.default", "aten.pow.Tensor_Scalar", "aten.erf.default",
      "aten.sin.default", "aten.cos.default", "aten.reciprocal.default", "aten.square.default",
      "aten.neg.default", "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
      "aten.detach.default")
def unary(draw):
    seeded(draw)
    x = randn(shape(draw, 0, 4))
    exponent = draw(st.sampled_from([2, 3, 0.5, -1.5]))

    def f(self, x):
        pos = x.abs() + 0.5
        return (F.gelu(x), F.relu(x), F.silu(x), torch.tanh(x), torch.sigmoid(x), torch.exp(x),
                torch.log(pos), torch.rsqrt(pos), torch.sqrt(pos), pos ** exponent, torch.erf(x),
                torch.sin(x), torch.cos(x), torch.reciprocal(pos), torch.square(x), -x, x.clone(),
                aten.contiguous.default(x), aten.alias.default(x), x.detach())
    return Fn(f), (x,)


@case("aten.gelu_.default", "aten.relu_.default")
def unary_inplace(draw):
    seeded(draw)
    x = randn(shape(draw, 0, 4))

    def f(self, x):
        a, b = x * 1.0, x * 1.0
        aten.gelu_.default(a)
        torch.relu_(b)
        return a, b
    return Fn(f), (x,)


@case("aten.dropout.default")
def dropout(draw):
    seeded(draw)
    x = randn(shape(draw, 1, 4))
    p = draw(st.sampled_from([0.0, 0.25, 0.5]))
    return Fn(lambda self, x: F.dropout(x, p, training=True)), (x,)


@case("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
      "aten.lift_fresh_copy.default")
def conversions(draw):
    seeded(draw)
    x = randn(shape(draw, 0, 4))

    def f(self, x):
        c = torch.tensor([1.5, 2.5], dtype=DT)          # constant: lift_fresh_copy
        return (aten._to_copy.default(x, dtype=torch.float32), x.to(torch.float32),
                x.to(torch.float32, copy=True), x.to("cpu") * 1, x.to(device="cpu", dtype=torch.float32),
                c * 2)
    return Fn(f), (x,)


@case("aten.type_as.default")
def type_as(draw):
    seeded(draw)
    x = randn(shape(draw, 0, 4))
    y = torch.zeros(shape(draw, 0, 2), dtype=draw(st.sampled_from([torch.float32, torch.float64])))
    return Fn(lambda self, x, y: x.type_as(y)), (x, y)


@case("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device")
def casts_to_integer(draw):
    """Casts are declared linear; a cast to an integer or bool dtype is not (it rounds each summand)."""
    seeded(draw)
    x = randn(shape(draw, 0, 3)) * 3
    dt = draw(st.sampled_from([torch.int64, torch.int32, torch.bool]))

    def f(self, x):
        return aten._to_copy.default(x, dtype=dt), x.to(dt), aten.to.dtype_layout(x, dtype=dt), x.to("cpu", dt)
    return Fn(f), (x,)


@case("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
      "aten.add.Scalar", "aten.mul.Scalar", "aten.div.Scalar")
def scalar_arith(draw):
    seeded(draw)
    x = randn(shape(draw, 0, 4))
    c = draw(st.sampled_from([-2.0, 0.5, 3.0, 2]))
    alpha = draw(st.sampled_from([1, 2]))

    def f(self, x):
        return (x + c, x - c, torch.sub(x, c, alpha=alpha), x * c, x / c,
                aten.add.Scalar(x, c), aten.mul.Scalar(x, c), aten.div.Scalar(x, c))
    return Fn(f), (x,)


@case("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
      "aten.maximum.default", "aten.minimum.default", "aten.eq.Tensor", "aten.pow.Tensor_Tensor")
def binary_broadcast(draw):
    seeded(draw)
    full = shape(draw, 0, 4)
    a = ints_as_float(broadcast_operand(draw, full))
    b = ints_as_float(broadcast_operand(draw, full))
    alpha = draw(st.sampled_from([1, 2]))

    def f(self, a, b):
        return (a + b, b + a, torch.add(a, b, alpha=alpha), a - b, b - a, a * b, b * a,
                a / (b.abs() + 1), torch.maximum(a, b), torch.minimum(b, a), a == b,
                (a.abs() + 0.5) ** b)
    return Fn(f), (a, b)


@case("aten.eq.Scalar", "aten.ne.Scalar", "aten.lt.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
      "aten.le.Scalar", "aten.logical_not.default")
def compare_scalar(draw):
    seeded(draw)
    x = ints_as_float(shape(draw, 0, 4))
    c = draw(st.sampled_from([-1, 0, 1.0]))

    def f(self, x):
        return x == c, x != c, x < c, x > c, x >= c, x <= c, torch.logical_not(x > c)
    return Fn(f), (x,)


@case("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.masked_fill.Scalar",
      "aten.masked_fill.Tensor")
def where_mask(draw):
    seeded(draw)
    full = shape(draw, 1, 4)
    x = randn(full)
    y = randn(broadcast_operand(draw, full))
    mask = torch.rand(broadcast_operand(draw, full)) > 0.5
    v = draw(st.sampled_from([0.0, -1.5]))

    def f(self, x, y, mask):
        return (torch.where(mask, x, y), torch.where(mask, y, x), x.masked_fill(mask, v),
                x.masked_fill(mask, torch.tensor(v, dtype=DT)), torch.where(mask, x, v), torch.where(mask, v, y))
    return Fn(f), (x, y, mask)


# ---------------------------------------------------------------- contractions

@case("aten.linear.default")
def linear(draw):
    seeded(draw)
    k, n = draw(SIZES), draw(SIZES)
    x = randn(shape(draw, 0, 2) + (k,))
    lin = nn.Linear(k, n, bias=draw(st.booleans())).to(DT)
    return Fn(lambda self, x: self.lin(x), lin=lin), (x,)


@case("aten.matmul.default")
def matmul(draw):
    seeded(draw)
    m, k, n = draw(SIZES), draw(SIZES), draw(SIZES)
    batch = shape(draw, 0, 2)
    a_nd, b_nd = draw(st.integers(1, 2 + len(batch))), draw(st.integers(1, 2 + len(batch)))

    def operand(nd, tail):
        if nd == 1:
            return (k,)
        lead = batch[len(batch) - (nd - 2):]
        return tuple(1 if draw(st.booleans()) else s for s in lead) + tail
    a, b = randn(operand(a_nd, (m, k))), randn(operand(b_nd, (k, n)))
    return Fn(lambda self, a, b: a @ b), (a, b)


@case("aten.mm.default", "aten.bmm.default", "aten.addmm.default")
def mm_bmm_addmm(draw):
    seeded(draw)
    bt, m, k, n = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
    a, b = randn((m, k)), randn((k, n))
    c, d = randn((bt, m, k)), randn((bt, k, n))
    bias = randn(draw(st.sampled_from([(n,), (m, n), (1, n), (m, 1), ()])))
    beta, alpha = draw(st.sampled_from([1, 0.5])), draw(st.sampled_from([1, 2.0]))

    def f(self, a, b, c, d, bias):
        return torch.mm(a, b), torch.bmm(c, d), aten.addmm.default(bias, a, b, beta=beta, alpha=alpha)
    return Fn(f), (a, b, c, d, bias)


@case("aten.embedding.default")
def embedding(draw):
    seeded(draw)
    v, dim = draw(SIZES), draw(SIZES)
    idx = torch.randint(0, v, shape(draw, 0, 3))
    emb = nn.Embedding(v, dim, padding_idx=draw(st.sampled_from([None, 0]))).to(DT)
    return Fn(lambda self, idx: self.emb(idx), emb=emb), (idx,)


@case("aten.scaled_dot_product_attention.default")
def sdpa(draw):
    nb = draw(st.integers(1, 2))
    batch = shape(draw, nb, nb)
    return _sdpa(draw, batch, batch, False)


@case("aten.scaled_dot_product_attention.default")
def sdpa_gqa(draw):
    """Grouped-query attention: fewer key/value heads than query heads."""
    heads = draw(st.sampled_from([2, 4, 6, 8]))
    kv_heads = draw(st.sampled_from([h for h in range(1, heads) if heads % h == 0]))
    b = draw(SIZES)
    return _sdpa(draw, (b, heads), (b, kv_heads), True)


def _sdpa(draw, batch, kv_batch, gqa):
    seeded(draw)
    L, S, E, Fv = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
    q, k, v = randn(batch + (L, E)), randn(kv_batch + (S, E)), randn(kv_batch + (S, Fv))
    kind = draw(st.sampled_from(["none", "bool", "float", "causal"]))
    inputs = [q, k, v]
    if kind in ("bool", "float"):
        mshape = broadcast_operand(draw, batch + (L, S))
        mshape = (L, S)[:2 - len(mshape)] + mshape if len(mshape) < 2 else mshape  # sdpa needs a 2-d mask
        if kind == "bool":
            mask = torch.rand(mshape) > 0.5
            mask[..., 0] = True      # every query sees a key: no NaN rows
        else:
            mask = randn(mshape)
        inputs.append(mask)
    scale = draw(st.sampled_from([None, 0.5]))

    def f(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None,
                                              is_causal=kind == "causal", scale=scale, enable_gqa=gqa)
    return Fn(f), tuple(inputs)


# ---------------------------------------------------------------- normalizations, scans, reductions

@case("aten.layer_norm.default")
def layer_norm(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    k = draw(st.integers(1, len(shp)))
    affine = draw(st.booleans())
    ln = nn.LayerNorm(shp[-k:], elementwise_affine=affine, bias=affine and draw(st.booleans())).to(DT)
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            if ln.bias is not None:
                ln.bias.normal_()
    return Fn(lambda self, x: self.ln(x), ln=ln), (randn(shp),)


@case("aten.softmax.int", "aten.log_softmax.int", "aten._softmax.default", "aten._log_softmax.default",
      "aten.cumsum.default")
def softmax(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    d = dim_of(draw, len(shp))

    def f(self, x):
        return (x.softmax(d), F.log_softmax(x, d), aten._softmax.default(x, d, False),
                aten._log_softmax.default(x, d, False), x.cumsum(d))
    return Fn(f), (randn(shp),)


@case("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default")
def reductions(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    nd = len(shp)
    dims = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
    dims = [d - nd if draw(st.booleans()) else d for d in dims]
    keepdim = draw(st.booleans())

    def f(self, x):
        return (x.sum(dims, keepdim=keepdim), x.sum(dims[0]), x.sum(), x.mean(dims, keepdim=keepdim),
                x.mean(dims[0], keepdim=keepdim), x.mean())
    return Fn(f), (randn(shp),)


# ---------------------------------------------------------------- views and layout

@case("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints")
def views(draw):
    seeded(draw)
    shp = shape(draw, 2, 4)
    a, b, c = regroup(draw, shp), regroup(draw, shp), regroup(draw, shp)
    # -1 in place of one entry (the size is inferred; localizing keeps it)
    if a and draw(st.booleans()):
        i = draw(st.integers(0, len(a) - 1))
        a = a[:i] + (-1,) + a[i + 1:]
    s = draw(st.integers(0, len(shp) - 2))
    e = draw(st.integers(s + 1, len(shp) - 1))

    def f(self, x):
        return x.view(a), x.reshape(b), aten._unsafe_view.default(x, list(c)), x.flatten(s, e)
    return Fn(f), (randn(shp),)


@case("aten.transpose.int", "aten.t.default", "aten.permute.default")
def transposes(draw):
    seeded(draw)
    shp = shape(draw, 2, 4)
    nd = len(shp)
    d0 = dim_of(draw, nd)
    d1 = draw(st.sampled_from([d for d in range(nd) if d != d0 % nd]))
    perm = draw(st.permutations(range(nd)))
    perm = [p - nd if draw(st.booleans()) else p for p in perm]
    m = randn(shape(draw, 1, 2))

    def f(self, x, m):
        return x.transpose(d0, d1), m.t(), x.permute(perm)
    return Fn(f), (randn(shp), m)


@case("aten.unsqueeze.default")
def unsqueeze(draw):
    seeded(draw)
    shp = shape(draw, 0, 4, sizes=st.sampled_from([1, 1, 2, 4, 6]))
    u = draw(st.integers(-len(shp) - 1, len(shp)))
    return Fn(lambda self, x: x.unsqueeze(u)), (randn(shp),)


@case("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def squeezes(draw):
    seeded(draw)
    shp = shape(draw, 1, 4, sizes=st.sampled_from([1, 1, 2, 4, 6]))
    nd = len(shp)
    d = dim_of(draw, nd)
    ds = tuple(draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True)))

    def f(self, x):
        return x.squeeze(d), x.squeeze(ds), x.squeeze()
    return Fn(f), (randn(shp),)


@case("aten.expand.default")
def expand(draw):
    seeded(draw)
    shp = shape(draw, 0, 3, sizes=st.sampled_from([1, 1, 2, 4, 6]))
    lead = shape(draw, 0, 2)
    target = list(lead)
    for s in shp:
        if s == 1:
            target.append(draw(st.sampled_from([1, 2, 4, 3, -1])))
        else:
            target.append(draw(st.sampled_from([s, -1])))
    return Fn(lambda self, x: x.expand(target)), (randn(shp),)


@case("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "_operator.getitem")
def splits(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    nd = len(shp)
    d = dim_of(draw, nd)
    size = shp[d]
    k = draw(st.integers(1, size))
    cut = sorted(draw(st.lists(st.integers(1, size - 1), max_size=3, unique=True))) if size > 1 else []
    sizes = [b - a for a, b in zip([0] + cut, cut + [size])]
    n = draw(st.integers(1, 4))

    def f(self, x):
        return (*x.split(k, d), *x.split(sizes, d), *x.chunk(n, d))
    return Fn(f), (randn(shp),)


@case("aten.unbind.int", "_operator.getitem")
def unbind(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    d = dim_of(draw, len(shp))
    return Fn(lambda self, x: x.unbind(d)), (randn(shp),)


@case("aten.cat.default")
def cat(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    d = dim_of(draw, len(shp))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        s = list(shp)
        s[d] = draw(SIZES)
        parts.append(randn(tuple(s)))
    return Fn(lambda self, *xs: torch.cat(xs, d)), tuple(parts)


@case("aten.slice.Tensor", "aten.select.int")
def slice_select(draw):
    seeded(draw)
    shp = shape(draw, 1, 4)
    nd = len(shp)
    d = dim_of(draw, nd)
    size = shp[d % nd]
    start = draw(st.sampled_from([0, 1, -1, -size, None]))
    end = draw(st.sampled_from([size, INT_MAX, -1, 2, None]))
    step = draw(st.sampled_from([1, 1, 2]))
    whole = (0, INT_MAX)  # x[:, 0:] as the training IR writes a whole-dim slice
    i = draw(st.integers(-size, size - 1))

    def f(self, x):
        return (aten.slice.Tensor(x, d, start, end, step), aten.slice.Tensor(x, d, *whole),
                x.select(d, i))
    return Fn(f), (randn(shp),)


@case("aten.triu.default", "aten.tril.default")
def triangles(draw):
    seeded(draw)
    shp = shape(draw, 2, 4)
    k = draw(st.integers(-2, 2))
    return Fn(lambda self, x: (torch.triu(x, k), torch.tril(x, -k))), (randn(shp),)


# ---------------------------------------------------------------- factories

@case("aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
      "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default",
      "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
      "aten.empty_like.default", "aten.randn.default", "aten.rand.default", "aten.new_ones.default",
      "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default")
def factories(draw):
    seeded(draw)
    shp = shape(draw, 1, 3)
    n = draw(st.integers(1, 8))
    v = draw(st.sampled_from([0.5, -2.0]))

    def f(self, x):
        return (torch.arange(n), torch.arange(1, n + 1), torch.arange(0, 2 * n, 2),
                torch.zeros(shp, dtype=DT), torch.ones(shp, dtype=DT), torch.full(shp, v, dtype=DT),
                torch.empty(shp, dtype=DT), torch.scalar_tensor(v, dtype=DT), torch.zeros_like(x),
                torch.ones_like(x), torch.full_like(x, v), torch.empty_like(x),
                torch.randn(shp, dtype=DT), torch.rand(shp, dtype=DT), x.new_ones(shp), x.new_zeros((n,)),
                x.new_full(shp, v), x.new_empty((n, 2)))
    return Fn(f), (randn(shp),)


@case("aten.le.Tensor", "aten.lt.Tensor", "aten.gt.Tensor", "aten.ge.Tensor", "aten.ne.Tensor",
      "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
      "aten.logical_and.default", "aten.logical_or.default")
def compare_and_logic(draw):
    seeded(draw)
    full = shape(draw, 0, 4)
    a = ints_as_float(broadcast_operand(draw, full))
    b = ints_as_float(broadcast_operand(draw, full))

    def f(self, a, b):
        le, gt = a <= b, a > b
        return (le, a < b, gt, a >= b, a != b, le & gt, le | gt, torch.bitwise_and(le, gt),
                torch.bitwise_or(le, gt), torch.logical_and(a, b), torch.logical_or(a, b))
    return Fn(f), (a, b)


@case("aten.index.Tensor")
def advanced_index(draw):
    """x[i, j] with broadcasting index tensors (HF builds its causal masks this way), and x[:, j] (a whole
    leading dim, as capture/iota_index.py rewrites HF's padding mask)."""
    seeded(draw)
    rows, cols, extra = draw(SIZES), draw(SIZES), shape(draw, 0, 2)
    x = randn((rows, cols) + extra)
    batch = draw(st.sampled_from([1, 2, 4]))
    i = torch.randint(0, rows, (batch, 1))
    j = torch.randint(0, cols, (draw(st.sampled_from([1, 4])),))
    return Fn(lambda self, x, i, j: (x[i, j], x[i], x[:, j]), ), (x, i, j)


@case("aten.diff.default")
def diff(draw):
    """Differences of neighbours along a dim, with and without prepended / appended slices."""
    seeded(draw)
    shp = shape(draw, 1, 3)
    d = draw(st.integers(0, len(shp) - 1))
    pre = randn(shp[:d] + (1,) + shp[d + 1:])

    def f(self, x, pre):
        return torch.diff(x, dim=d), torch.diff(x, n=1, dim=d, prepend=pre), torch.diff(x, dim=d, append=pre)
    return Fn(f), (randn(shp), pre)


# ---------------------------------------------------------------- losses and padding

@case("aten.cross_entropy_loss.default")
def cross_entropy(draw):
    """Every reduction, ignored targets, class weights, label smoothing; (N, C) and (N, C, d).
    An unweighted mean is captured as sum / count (autopar.losses), which splits over N."""
    seeded(draw)
    n, c = draw(SIZES), draw(st.sampled_from([2, 3, 5]))
    extra = shape(draw, 0, 1)
    x = randn((n, c) + extra)
    t = torch.randint(0, c, (n,) + extra)
    t[torch.rand(t.shape) < 0.3] = -100
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))
    weight = torch.rand(c, dtype=DT) + 0.5 if draw(st.booleans()) else None
    smoothing = draw(st.sampled_from([0.0, 0.1]))

    def f(self, x, t):
        return F.cross_entropy(x, t, weight=weight, reduction=reduction, label_smoothing=smoothing)
    return Fn(f), (x, t)


@case("aten.pad.default", "aten.constant_pad_nd.default")
def pad(draw):
    """Constant padding of the trailing dims (HF pads labels by one to shift them)."""
    seeded(draw)
    shp = shape(draw, 2, 3)
    pads = draw(st.lists(st.integers(0, 2), min_size=2, max_size=2 * len(shp)).filter(lambda p: len(p) % 2 == 0))
    value = draw(st.sampled_from([0.0, -100.0]))

    def f(self, x):
        return F.pad(x, pads, value=value), aten.constant_pad_nd(x, pads, value)
    return Fn(f), (randn(shp),)
