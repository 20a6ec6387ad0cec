"""What each op keeps for backward: some of its inputs, its output, and tensors its kernel makes
only for backward (layer_norm's mean and rstd, attention's logsumexp, dropout's mask).

The kernel depends on the hardware: CPU dropout multiplies by a noise tensor of
the input's dtype, CUDA's fused dropout keeps a bool mask; CPU layer_norm keeps
its statistics in the input's dtype, CUDA in fp32; CUDA attention pads its
logsumexp. CPU entries were measured with torch.autograd.graph.saved_tensors_hooks
on torch 2.13; CUDA entries follow the kernels' sources (no GPU measured them).

A table per op, kept apart from activations.py, which decides who pays for what
is kept (storages shared by views, layouts): a new op needs an entry here only.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from ..capture.export import Captured, TensorMeta
from ..sharding.op_spec import op_arg, op_name, tensor_args
from ..sharding.placement import P

CPU, CUDA = "cpu", "cuda"


def kernel_family(hardware) -> str:
    """Whose kernels run: CPU for the "cpu" presets, CUDA for accelerators (h100, a100, ...).
    `hardware`: a cost_models.Hardware, or its name (a plan's `hardware`)."""
    name = hardware if isinstance(hardware, str) else hardware.name
    return CPU if name.lower().startswith("cpu") else CUDA


# --------------------------------------------------------------------------- what an op keeps

@dataclass(frozen=True)
class Arg:
    """The op keeps its tensor input `index` (tensor_args order)."""
    index: int
    needs: tuple | None = None  # kept only if one of these inputs requires grad; None: whenever the op does
    unless: frozenset = frozenset()  # not kept when some axis has one of these output placements


@dataclass(frozen=True)
class Out:
    """The op keeps its own output (element `index` of a tuple output)."""
    index: int | None = None


@dataclass(frozen=True)
class New:
    """A tensor the kernel makes for backward, laid out like the leading `dims` dims of
    the output (follows=None) or of tensor input `follows`; its other dims are whole."""
    meta: TensorMeta
    follows: int | None = None
    dims: int = 0
    when: frozenset | None = None  # kept only when some axis has one of these output placements
    unless: frozenset = frozenset()  # not kept when some axis has one of these output placements


def _meta(shape, hint, dtype) -> TensorMeta:
    return TensorMeta(tuple(sympy.sympify(s) for s in shape), tuple(int(h) for h in hint), dtype)


def _like(m: TensorMeta, dtype=None) -> TensorMeta:
    return TensorMeta(m.shape, m.hint, dtype or m.dtype)


def _leading(m: TensorMeta, k: int, dtype, trailing_ones: int = 0) -> TensorMeta:
    """The first k dims of m (then `trailing_ones` dims of size 1), in dtype."""
    ones = (sympy.Integer(1),) * trailing_ones
    return TensorMeta(m.shape[:k] + ones, m.hint[:k] + (1,) * trailing_ones, dtype)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """CUDA kernels accumulate half types (and fp32) in fp32, doubles in doubles."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ops that keep their input: the derivative is a function of it
_KEEP_INPUT = ["gelu", "silu", "log", "abs", "sin", "cos", "erf", "square", "clamp", "var.dim", "var.correction",
               "pow.Tensor_Scalar", "log1p", "elu", "mish", "softplus", "hardswish", "leaky_relu"]
# ops that keep their output: the derivative is a function of it
_KEEP_OUTPUT = ["relu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "reciprocal", "softmax.int",
                "_softmax", "log_softmax.int", "_log_softmax"]
# each operand is kept for the other's gradient only
_BILINEAR = {"aten.linear.default": (0, 1), "aten.matmul.default": (0, 1), "aten.mm.default": (0, 1),
             "aten.bmm.default": (0, 1), "aten.mul.Tensor": (0, 1), "aten.addmm.default": (1, 2)}


def _names(short: list) -> list:
    return [f"aten.{s}" if "." in s else f"aten.{s}.default" for s in short]


SIMPLE_KEEPS: dict[str, tuple] = {
    **{n: (Arg(0),) for n in _names(_KEEP_INPUT)},
    **{n: (Out(),) for n in _names(_KEEP_OUTPUT)},
    **{n: (Arg(a, (b,)), Arg(b, (a,))) for n, (a, b) in _BILINEAR.items()},
    "aten.div.Tensor": (Arg(0, (1,)), Arg(1, (0, 1))),      # d/db (a/b) = -a/b^2
    "aten.maximum.default": (Arg(0), Arg(1)), "aten.minimum.default": (Arg(0), Arg(1)),
    "aten.std.dim": (Arg(0), Out()), "aten.std.correction": (Arg(0), Out()),
    "aten.pow.Tensor_Tensor": (Arg(0), Arg(1), Out()),
    "aten.where.self": (Arg(0),), "aten.where.ScalarOther": (Arg(0),), "aten.where.ScalarSelf": (Arg(0),),
    "aten.masked_fill.Scalar": (Arg(1),), "aten.masked_fill.Tensor": (Arg(1),),
    "aten.gather.default": (Arg(0), Arg(1)), "aten.index_select.default": (Arg(1),),
    "aten.native_dropout.default": (Out(1),),              # the mask: bool on CPU and CUDA
}


def _layer_norm(node, ins, out, kernels):
    # native_layer_norm keeps input, weight and bias plus per-row mean and rstd, shaped like
    # the input with the normalized dims of size 1: in the input dtype on CPU, fp32 on CUDA
    nd = len(node.args[1])
    lead = ins[0].ndim - nd
    stat = ins[0].dtype if kernels == CPU else _accumulate(ins[0].dtype)
    keeps = [Arg(i) for i in range(len(ins))]
    keeps += [New(_leading(ins[0], lead, stat, nd), dims=lead)] * 2
    return keeps


def _rms_norm(node, ins, out, kernels):
    nd = len(node.args[1])
    lead = ins[0].ndim - nd
    rstd = New(_leading(ins[0], lead, torch.float32, nd), dims=lead)
    if kernels == CUDA:   # _fused_rms_norm: input, weight, fp32 rstd
        return [Arg(i) for i in range(len(ins))] + [rstd]
    # CPU runs the composite: x upcast to fp32 (x itself when already fp32), rstd, and the
    # normalized fp32 x that the weight's gradient needs
    x = Arg(0) if ins[0].dtype == torch.float32 else New(_like(ins[0], torch.float32), dims=ins[0].ndim)
    keeps = [x, rstd] + [Arg(i) for i in range(1, len(ins))]
    if len(ins) > 1:
        keeps.append(New(_like(ins[0], torch.float32), dims=ins[0].ndim))
    return keeps


def _dropout(node, ins, out, kernels):
    p, train = op_arg(node, 1, "p", 0.5), op_arg(node, 2, "train", True)
    if not train or p == 0:
        return []      # returns its input (storage_owners aliases the two)
    # CPU: input * noise, noise in the input's dtype; CUDA: native_dropout's bool mask
    return [New(_like(out, out.dtype if kernels == CPU else torch.bool), dims=out.ndim)]


def _embedding(node, ins, out, kernels):
    # A whole table keeps the indices. A vocab-split table (partial-sum output) runs
    # runtime/lowering/vocab_parallel.vocab_parallel_embedding: it keeps the shifted indices and the bool mask of
    # the tokens outside this rank's rows instead, both shaped like the indices.
    split = frozenset({P})
    return [Arg(1, unless=split),
            New(ins[1], follows=1, dims=ins[1].ndim, when=split),
            New(_like(ins[1], torch.bool), follows=1, dims=ins[1].ndim, when=split)]


def _cross_entropy(node, ins, out, kernels):
    # aten's: log_softmax's output (input shape and dtype), the targets and nll_loss's total weight.
    # Split classes (partial-sum output, reduction "none" only: rules.cross_entropy_rule) run
    # runtime/lowering/vocab_parallel.py's op instead, which keeps only the gradient's factor, shaped
    # and typed like its slice of the input.
    if op_arg(node, 3, "reduction", 1) != 0:
        return [New(ins[0], follows=0, dims=ins[0].ndim), Arg(1), New(_meta((), (), ins[0].dtype))]
    split = frozenset({P})
    return [New(ins[0], follows=0, dims=ins[0].ndim, unless=split), Arg(1, unless=split),
            New(_meta((), (), ins[0].dtype), unless=split), New(ins[0], follows=0, dims=ins[0].ndim, when=split)]


def _nll_loss(node, ins, out, kernels):
    return [Arg(0), Arg(1), New(_meta((), (), ins[0].dtype))]


def _index(node, ins, out, kernels):
    return [Arg(i) for i in range(1, len(ins))]   # the index tensors


def _sdpa(node, ins, out, kernels):
    q, k, v = ins[:3]
    mask = ins[3] if len(ins) > 3 else None
    dropout = op_arg(node, 4, "dropout_p", 0.0)
    nb = q.ndim - 2
    same_head_dim = q.hint[-1] == k.hint[-1] == v.hint[-1]
    qkv_out = [Arg(0), Arg(1), Arg(2), Out()]
    if kernels == CPU and q.ndim == 4 and dropout == 0 and same_head_dim:
        # _scaled_dot_product_flash_attention_for_cpu: q, k, v, out, fp32 logsumexp [B, H, L];
        # a bool mask is converted to an additive mask of the query's dtype, which it keeps
        keeps = qkv_out + [New(_leading(q, q.ndim - 1, torch.float32), dims=q.ndim - 1)]
        if mask is not None:
            keeps.append(Arg(3) if mask.dtype != torch.bool else
                         New(_like(mask, q.dtype), follows=3, dims=mask.ndim))
        return keeps
    half = q.dtype in (torch.float16, torch.bfloat16)
    if kernels == CUDA and q.ndim == 4 and q.hint[-1] % 8 == 0 and same_head_dim:
        if half and mask is None and q.hint[-1] <= 256:
            # flash attention: q, k, v, out, fp32 logsumexp [B, H, L] (plus two scalar RNG states)
            return qkv_out + [New(_leading(q, q.ndim - 1, torch.float32), dims=q.ndim - 1)]
        # memory-efficient attention: logsumexp [B, H, L rounded up to 32] in fp32; a mask is
        # kept as an additive bias of the query's dtype, its last dim padded to a multiple of 16
        L = q.shape[-2]
        lse = _meta(q.shape[:nb] + (sympy.ceiling(L / 32) * 32,),
                    q.hint[:nb] + (-(-q.hint[-2] // 32) * 32,), torch.float32)
        keeps = qkv_out + [New(lse, dims=nb)]
        if mask is not None:
            padded = -(-mask.hint[-1] // 16) * 16
            if mask.dtype != torch.bool and padded == mask.hint[-1]:
                keeps.append(Arg(3))
            else:
                m = _meta(mask.shape[:-1] + (sympy.ceiling(mask.shape[-1] / 16) * 16,),
                          mask.hint[:-1] + (padded,), q.dtype)
                keeps.append(New(m, follows=3, dims=mask.ndim - 1))
        return keeps
    # the math fallback: scaled q and k, the attention probabilities [..., L, S], v;
    # with dropout also its mask and the dropped probabilities
    probs = _meta(q.shape[:nb] + (q.shape[-2], k.shape[-2]), q.hint[:nb] + (q.hint[-2], k.hint[-2]), q.dtype)
    keeps = [New(q, dims=nb), New(_like(k, q.dtype), follows=1, dims=nb), New(probs, dims=nb), Arg(2)]
    if dropout:
        keeps += [New(probs, dims=nb)] * 2
    return keeps


RULE_KEEPS = {
    "aten.layer_norm.default": _layer_norm, "aten.rms_norm.default": _rms_norm,
    "aten.dropout.default": _dropout, "aten.embedding.default": _embedding,
    "aten.cross_entropy_loss.default": _cross_entropy,
    **{f"aten.{n}": _nll_loss for n in ("nll_loss.default", "nll_loss_nd.default", "nll_loss_forward.default",
                                        "nll_loss2d_forward.default")},
    "aten.index.Tensor": _index, "aten.scaled_dot_product_attention.default": _sdpa,
}


def op_keeps(node: fx.Node, cap: Captured, kernels: str) -> list:
    """What `node` keeps for backward when it runs on `kernels` ("cpu" or "cuda") and its
    output requires grad. Ops not listed keep nothing (views, adds, reductions, casts)."""
    name = op_name(node)
    if name in SIMPLE_KEEPS:
        return list(SIMPLE_KEEPS[name])
    rule = RULE_KEEPS.get(name)
    if rule is None:
        return []
    ins = [first_of(cap.info[a.name].meta) for a in tensor_args(node)]
    out = first_of(cap.info[node.name].meta)
    return rule(node, ins, out, kernels)


def first_of(meta):
    """The TensorMeta of a node's value, or of its first element for a tuple output."""
    return meta[0] if isinstance(meta, list) else meta
