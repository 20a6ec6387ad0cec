"""Activation memory: the bytes autograd keeps from forward for backward, per device.

Three facts decide them; each has its part below.

1. What an op keeps (`op_keeps`): some of its inputs, its output, and tensors
   its kernel makes only for backward (layer_norm's mean and rstd, attention's
   logsumexp, dropout's mask). The kernel depends on the hardware: CPU dropout
   multiplies by a noise tensor of the input's dtype, CUDA's fused dropout keeps
   a bool mask; CPU layer_norm keeps its statistics in the input's dtype, CUDA
   in fp32; CUDA attention pads its logsumexp. CPU entries were measured with
   torch.autograd.graph.saved_tensors_hooks on torch 2.13; CUDA entries follow
   the kernels' sources (no GPU measured them).
2. Storage (`storage_owners`): autograd keeps tensors, and a view keeps its
   base's whole storage alive. A linear's output, its head-split view and the
   transposed view attention keeps are one storage and cost it once, however
   many ops keep it. Which graph values share a storage comes from the traced
   fake tensors (a reshape that had to copy does not share), plus the ops that
   return their input at run time although their schema says otherwise
   (dropout with p = 0 or train=False).
3. Who pays, in which layout (`activation_model`): each kept storage is
   charged to exactly one node, so the ILP's memory term stays a sum over
   nodes, linear in each node's strategy:
   - a tensor an op makes and keeps itself (its output, its kernel's extras):
     that op, in its output layout;
   - a tensor an op keeps from its inputs: the first op that keeps that
     storage, in the layout that op takes the input in. That is what is
     really kept: where the producer's layout differs, a redistribution sits
     between them and the op keeps its result (the all-gathered norm output
     a sequence-parallel column-parallel linear keeps; the reduce-scattered
     embedding a norm keeps);
   - a storage of which an op keeps only a part (one piece of a fused qkv
     projection): all of it, by the op that made it, in its output layout.
   A node's strategy is known here only by its output placements; an input
   layout is read off the op's sharding rule: the output's split letters, and
   for a partial-sum output the contracted letter (a row-parallel linear), not
   partial sums passed through.

Not modelled: two ops keeping one tensor in two different layouts (counted
once); a partial view that is redistributed; a replicated tensor chunked along
dim 0 (the chunk is a view of it, so the whole stays alive).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from .._compat import storage_id
from ..capture.export import BUFFER, INPUT, OP, PARAM, Captured, TensorMeta
from ..sharding.placement import P, R, S
from ..sharding.rules import OpSpec, op_name, rule_for, tensor_args

CPU, CUDA = "cpu", "cuda"


def kernel_family(hardware) -> str:
    """Whose kernels run: CPU for the "cpu" presets, CUDA for accelerators (h100, a100, ...)."""
    return CPU if hardware.name.lower().startswith("cpu") else CUDA


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


def _arg(node: fx.Node, pos: int, name: str, default):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


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
    "aten.where.self": (Arg(0),), "aten.masked_fill.Scalar": (Arg(1),), "aten.masked_fill.Tensor": (Arg(1),),
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
    p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
    if not train or p == 0:
        return []      # returns its input (storage_owners aliases the two)
    # CPU: input * noise, noise in the input's dtype; CUDA: native_dropout's bool mask
    return [New(_like(out, out.dtype if kernels == CPU else torch.bool), dims=out.ndim)]


def _embedding(node, ins, out, kernels):
    # A whole table keeps the indices. A vocab-split table (partial-sum output) runs
    # rewrite.vocab_parallel_embedding: it keeps the shifted indices and the bool mask of
    # the tokens outside this rank's rows instead, both shaped like the indices.
    split = frozenset({P})
    return [Arg(1, unless=split),
            New(ins[1], follows=1, dims=ins[1].ndim, when=split),
            New(_like(ins[1], torch.bool), follows=1, dims=ins[1].ndim, when=split)]


def _cross_entropy(node, ins, out, kernels):
    # log_softmax's output (input shape and dtype), the targets and nll_loss's total weight
    return [New(ins[0], follows=0, dims=ins[0].ndim), Arg(1), New(_meta((), (), ins[0].dtype))]


def _nll_loss(node, ins, out, kernels):
    return [Arg(0), Arg(1), New(_meta((), (), ins[0].dtype))]


def _index(node, ins, out, kernels):
    return [Arg(i) for i in range(1, len(ins))]   # the index tensors


def _sdpa(node, ins, out, kernels):
    q, k, v = ins[:3]
    mask = ins[3] if len(ins) > 3 else None
    dropout = _arg(node, 4, "dropout_p", 0.0)
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
    ins = [_first(cap.info[a.name].meta) for a in tensor_args(node)]
    out = _first(cap.info[node.name].meta)
    return rule(node, ins, out, kernels)


def _first(meta):
    return meta[0] if isinstance(meta, list) else meta


# --------------------------------------------------------------------------- requires grad

def _no_grad_region(node: fx.Node) -> bool:
    """A torch.no_grad() block export kept as a higher-order op (e.g. rotary embeddings)."""
    return "wrap_with_set_grad_enabled" in str(node.target) and node.args and node.args[0] is False


def requires_grad(cap: Captured) -> set[str]:
    """Nodes whose output requires grad: floating, downstream of a trainable parameter."""
    state = cap.exported.state_dict
    out = set()
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        m = _first(info.meta)
        if m is None or not m.dtype.is_floating_point:
            continue
        if info.kind == PARAM:
            p = state.get(info.target_name)
            if p is None or p.requires_grad:
                out.add(node.name)
        elif node.op == "call_function" and not _no_grad_region(node) and any(
                a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


# --------------------------------------------------------------------------- storages

Value = tuple  # (node name, element index of a tuple output or None)


def _returns_input(node: fx.Node) -> bool:
    """Ops that hand back their input at run time though their schema promises a new tensor."""
    if op_name(node) == "aten.dropout.default":
        return not _arg(node, 2, "train", True) or _arg(node, 1, "p", 0.5) == 0
    return False


def storage_owners(cap: Captured) -> dict[Value, Value]:
    """Each tensor value -> the value that first holds its storage (itself unless it is a view)."""
    first: dict = {}
    owner: dict[Value, Value] = {}
    for node in cap.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            items = [(None, val)]
        elif isinstance(val, (list, tuple)):
            items = [(k, v) for k, v in enumerate(val) if isinstance(v, torch.Tensor)]
        else:
            continue
        args = tensor_args(node) if node.op == "call_function" else []
        for k, v in items:
            value = (node.name, k)
            if k is None and args and _returns_input(node):
                owner[value] = owner.get((args[0].name, None), (args[0].name, None))
                continue
            owner[value] = first.setdefault(storage_id(v), value)
    return owner


# --------------------------------------------------------------------------- layouts

def op_spec(node: fx.Node, cap: Captured) -> OpSpec | None:
    """The sharding rule's letters for this call, or None where it runs replicated
    (as strategies.op_strategies decides)."""
    rule = rule_for(node)
    args = tensor_args(node)
    metas = [_first(cap.info[a.name].meta) for a in args]
    if rule is None or any(m is None for m in metas):
        return None
    if node.target is operator.getitem:
        metas = [cap.info[args[0].name].meta[node.args[1]]]
    try:
        spec = rule(node, metas, _first(cap.info[node.name].meta))
    except Exception:  # noqa: BLE001 -- as strategies.op_strategies: such a call runs replicated
        return None
    if spec.replicate_only or len(spec.inputs) != len(args):
        return None
    return spec


def _output_entries(out_ndim: int) -> list:
    return [R, P] + [S(d) for d in range(out_ndim)]


def output_cuts(out_ndim: int, dims) -> frozenset:
    """Output placements that split a tensor laid out like the output along one of `dims`."""
    return frozenset(S(d) for d in dims if d < out_ndim)


def input_cuts(spec: OpSpec | None, index: int, out_ndim: int, dims) -> frozenset:
    """Output placements under which the op takes input `index` split along one of its
    `dims`: the output's split letter when the input has it; for partial sums, the
    contracted letter (the first, as strategies lists them)."""
    if spec is None:
        return frozenset()
    letters = {spec.inputs[index][d] for d in dims if d < len(spec.inputs[index])}
    contracted = [c for s in spec.inputs for c in s if c not in spec.output and c not in spec.no_shard]
    cuts = set()
    for entry in _output_entries(out_ndim):
        if entry == R:
            continue
        if entry == P:
            letter = contracted[0] if contracted else None
        else:
            d = int(entry[2:-1])
            letter = spec.output[d] if d < len(spec.output) else None
        if letter is not None and letter in letters:
            cuts.add(entry)
    return frozenset(cuts)


def _through_whole_slices(node, cap: Captured):
    """The tensor behind slices that keep every element (x[:, :, None] traced with a dynamic dim
    slices each dim from 0 to its size; a static trace drops such slices)."""
    while isinstance(node, fx.Node) and op_name(node) == "aten.slice.Tensor" and isinstance(node.args[0], fx.Node):
        src, out = _first(cap.info[node.args[0].name].meta), _first(cap.info[node.name].meta)
        if src is None or out is None or src.shape != out.shape:
            break
        node = node.args[0]
    return node


def _repeated_heads(node: fx.Node, cap: Captured) -> tuple | None:
    """(dim, groups, repeats) if `node` is GQA's repeat_kv: reshape(expand(unsqueeze(x, j)))
    merging x's dim j-1 (the key/value heads) with `repeats` copies of each.

    Traced whole it copies. A rank that holds a single key/value head merges a size-1
    dim, which is a view: it keeps x's storage, `repeats` times smaller, instead.
    """
    if op_name(node) not in ("aten.reshape.default", "aten.flatten.using_ints") or not node.args:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or op_name(expand) != "aten.expand.default":
        return None
    unsq = _through_whole_slices(expand.args[0], cap)
    if not isinstance(unsq, fx.Node) or op_name(unsq) != "aten.unsqueeze.default" or \
            not isinstance(unsq.args[0], fx.Node):
        return None
    x = _first(cap.info[_through_whole_slices(unsq.args[0], cap).name].meta)
    e = _first(cap.info[expand.name].meta)
    out = _first(cap.info[node.name].meta)
    if x is None or e is None or out is None:
        return None
    j = unsq.args[1] % e.ndim
    if j == 0:
        return None
    repeats, groups = e.hint[j], x.hint[j - 1]
    merged = x.hint[:j - 1] + (groups * repeats,) + x.hint[j:]
    return (j - 1, groups, repeats) if out.hint == merged and repeats > 1 and groups > 1 else None


# --------------------------------------------------------------------------- who pays

@dataclass(frozen=True)
class Charge:
    """Bytes a node pays: `meta`'s, divided over the mesh axes whose entry in the node's
    output placements is in `cut_by`; only when some entry is in `when` (if given) and
    none in `unless`."""
    meta: TensorMeta
    cut_by: frozenset
    what: str
    when: frozenset | None = None
    unless: frozenset = frozenset()
    # (placements, pieces, factor): when the axes with these placements cut the tensor into
    # exactly `pieces`, the rank keeps a view of a `factor` times smaller storage instead
    view: tuple | None = None


@dataclass(frozen=True)
class ActivationModel:
    """What each node pays for the activations kept for backward, on one kind of kernels."""
    kernels: str
    charges: Mapping[str, tuple] = field(default_factory=dict)
    # nodes whose storage autograd keeps (in some layout): the makers of kept storages and
    # the kept values themselves, so a view-aware caller finds them under either name
    kept: frozenset = frozenset()
    # ops that keep some tensor (a weight too): backward's rerun of a checkpointed block stops after
    # the last of its ops that keeps one (torch.utils.checkpoint's early stop)
    keepers: frozenset = frozenset()


def _bytes_of(m: TensorMeta) -> int:
    return math.prod(m.hint) * m.itemsize


def kept_value(node: fx.Node, keep, args: list, grad: set) -> Value | None:
    """The graph value an `Arg` / `Out` entry of op_keeps names, or None where nothing is
    kept: a Python scalar operand, or an input kept only for a gradient nothing needs."""
    if not isinstance(keep, Arg):
        return (node.name, keep.index)
    if keep.index >= len(args):
        return None
    if keep.needs is not None and not any(j < len(args) and args[j].name in grad for j in keep.needs):
        return None
    return (args[keep.index].name, None)


def activation_model(cap: Captured, hardware, regions=()) -> ActivationModel:
    """Which node pays for each tensor autograd keeps when `cap` trains on `hardware`.

    `regions`: sets of op nodes run under activation checkpointing (one set a
    block). Their ops keep nothing; the checkpoint keeps each region's tensor
    inputs as they arrive (before any redistribution inside the region), so
    each is charged to its producer in the producer's output layout -- unless
    an op before the region keeps that storage already (then it is counted once).
    """
    kernels = kernel_family(hardware)
    grad = requires_grad(cap)
    owner = storage_owners(cap)
    charges: dict[str, list] = {}
    kept_by: dict[Value, list] = {}   # storage -> (keeper, keep, kept value), in graph order
    region_of = {n: i for i, region in enumerate(regions) for n in region}
    entered = set()
    keepers = set()

    def meta_of(value: Value) -> TensorMeta | None:
        m = cap.info[value[0]].meta
        return m[value[1]] if isinstance(m, list) and value[1] is not None else _first(m)

    for node in cap.graph.nodes:
        if node.name in region_of:
            i = region_of[node.name]
            if i not in entered:   # the checkpoint starts here and holds the region's inputs
                entered.add(i)
                for value in region_inputs(cap, regions[i]):
                    root = owner.get(value, value)
                    if cap.info[root[0]].kind in (OP, INPUT) and meta_of(root) is not None:
                        kept_by.setdefault(root, []).append((cap.node(value[0]), Out(value[1]), value))
            continue     # recomputed in backward: keeps nothing now
        if node.op != "call_function" or node.name not in grad:
            continue     # no grad_fn, nothing kept
        args = tensor_args(node)
        out = _first(cap.info[node.name].meta)
        spec = None
        for keep in op_keeps(node, cap, kernels):
            if isinstance(keep, New):
                if keep.follows is None:
                    cuts = output_cuts(out.ndim, range(keep.dims))
                else:
                    spec = spec or op_spec(node, cap)
                    cuts = input_cuts(spec, keep.follows, out.ndim, range(keep.dims))
                charges.setdefault(node.name, []).append(
                    Charge(keep.meta, cuts, f"{op_name(node)} kernel tensor", when=keep.when))
                keepers.add(node.name)
                continue
            value = kept_value(node, keep, args, grad)
            if value is None:
                continue
            keepers.add(node.name)
            root = owner.get(value, value)
            if cap.info[root[0]].kind in (PARAM, BUFFER):
                continue           # parameter memory, counted with the parameters
            if meta_of(value) is None or meta_of(root) is None:
                continue           # not a tensor export could describe
            kept_by.setdefault(root, []).append((node, keep, value))

    for root, uses in kept_by.items():
        whole = _bytes_of(meta_of(root))
        partial = any(_bytes_of(meta_of(v)) != whole for _, _, v in uses)
        if partial and cap.info[root[0]].kind == OP:
            # a piece keeps the whole storage alive: its maker pays for all of it
            m = meta_of(root)
            charges.setdefault(root[0], []).append(
                Charge(m, output_cuts(m.ndim, range(m.ndim)), f"{root[0]} (viewed)"))
            continue
        node, keep, value = uses[0]
        out = _first(cap.info[node.name].meta)
        m = meta_of(value)
        view = None
        if isinstance(keep, Out):
            cuts = output_cuts(m.ndim, range(m.ndim))
        else:
            spec = op_spec(node, cap)
            cuts = input_cuts(spec, keep.index, out.ndim, range(m.ndim))
            heads = _repeated_heads(cap.node(value[0]), cap)
            if heads is not None:
                dim, groups, repeats = heads
                view = (input_cuts(spec, keep.index, out.ndim, (dim,)), groups, repeats)
        charges.setdefault(node.name, []).append(
            Charge(meta_of(root) if partial else m, cuts, f"{value[0]} kept by {node.name}",
                   unless=keep.unless if isinstance(keep, Arg) else frozenset(), view=view))
    kept = {root[0] for root in kept_by} | {value[0] for uses in kept_by.values() for _, _, value in uses}
    return ActivationModel(kernels, {n: tuple(c) for n, c in charges.items()}, frozenset(kept), frozenset(keepers))


def region_inputs(cap: Captured, region) -> list[Value]:
    """Tensor values a region of ops reads from outside it (parameters and buffers included)."""
    out, seen = [], set()
    for name in region:
        for a in cap.node(name).all_input_nodes:
            if a.name in region or a.name in seen or cap.info[a.name].meta is None:
                continue
            seen.add(a.name)
            if a.op == "call_function" and a.target is operator.getitem:
                # one piece of a tuple: its own value, so the whole tuple is not charged
                out.append((a.args[0].name, a.args[1]))
            else:
                out.append((a.name, None))
    return out


def node_activation_bytes(model: ActivationModel, node: str, output, axis_sizes, symbolic=False):
    """Bytes `node` pays with output placements `output` (ints, or sympy with symbolic=True)."""
    total = 0
    for c in model.charges.get(node, ()):
        if c.when is not None and not any(p in c.when for p in output):
            continue
        if any(p in c.unless for p in output):
            continue
        pieces = math.prod(n for p, n in zip(output, axis_sizes) if p in c.cut_by)
        if c.view is not None:
            placements, whole, factor = c.view
            if math.prod(n for p, n in zip(output, axis_sizes) if p in placements) == whole:
                pieces *= factor
        if symbolic:
            total = total + math.prod(c.meta.shape) * c.meta.itemsize / pieces
        else:
            total = total + math.prod(c.meta.hint) * c.meta.itemsize // pieces
    return total
