"""Activation memory: the bytes autograd keeps from forward for backward, per device.

Three facts decide them.

1. What an op keeps: saved_tensors.py (`op_keeps`), per op and kernel family.
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

import torch
from torch import fx

from .._compat import storage_id
from ..capture.export import BUFFER, INPUT, OP, PARAM, Captured, TensorMeta
from ..capture.repeat_kv import repeated_heads
from ..sharding.op_spec import OpSpec, op_arg, op_name, tensor_args
from ..sharding.placement import P, R, S
from ..sharding.rules import SDPA, rule_for
from .saved_tensors import Arg, New, Out, first_of, kernel_family, op_keeps

# --------------------------------------------------------------------------- requires grad

def _no_grad_region(node: fx.Node) -> bool:
    """A torch.no_grad() block export kept as a higher-order op (e.g. rotary embeddings)."""
    return "wrap_with_set_grad_enabled" in str(node.target) and node.args and node.args[0] is False


def requires_grad(cap: Captured) -> set[str]:
    """Nodes whose output requires grad: floating, downstream of a trainable parameter."""
    out = set()
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        m = first_of(info.meta)
        if m is None or not m.dtype.is_floating_point:
            continue
        if info.kind == PARAM:
            if info.target_name not in cap.frozen_params:
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
        return not op_arg(node, 2, "train", True) or op_arg(node, 1, "p", 0.5) == 0
    return False


# ops that return their input as it is when its shape and dtype do not change (a cast to the same dtype,
# a view or reshape to the same shape, contiguous on a contiguous tensor); which ones did is read off the
# storages (storage_owners) and the shapes, not off the fake tensors' symbolic sizes: comparing those
# would run symbolic arithmetic, which another rank's export in this process may be tracing
_PASS_THROUGH = {"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.type_as.default",
                 "aten.alias.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                 "aten.contiguous.default", "aten.expand.default"}


def _same_tensor(node: fx.Node, arg: fx.Node, cap: Captured, owner: dict) -> bool:
    """Does `node` hand its input `arg` on as it is (the same storage, shape and dtype) at run time?"""
    if _returns_input(node):
        return True
    if op_name(node) not in _PASS_THROUGH or owner.get((node.name, None)) != owner.get((arg.name, None)):
        return False
    out, src = first_of(cap.info[node.name].meta), first_of(cap.info[arg.name].meta)
    return out is not None and src is not None and out.shape == src.shape and out.dtype == src.dtype


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
    metas = [first_of(cap.info[a.name].meta) for a in args]
    if rule is None or any(m is None for m in metas):
        return None
    if node.target is operator.getitem:
        metas = [cap.info[args[0].name].meta[node.args[1]]]
    try:
        spec = rule(node, metas, first_of(cap.info[node.name].meta))
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


def _repeated_heads(node: fx.Node, cap: Captured) -> tuple | None:
    """capture/repeat_kv.repeated_heads where it copies: traced whole, the merge copies; a rank that holds a
    single key/value head merges a size-1 dim, which is a view: it keeps x's storage, `repeats` times smaller,
    instead. With one key/value head in all, the merge is a view everywhere: nothing to tell apart."""
    heads = repeated_heads(node, cap)
    return heads if heads is not None and heads[1] > 1 else None


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
    follows: int | None = None   # a kernel tensor's: the tensor input it is laid out like (New.follows)


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
    # (op, tensor input index) -> how many tensors autograd keeps of the activation that op reads there,
    # by the op itself or by ops that read it through views and aliases of that op's output
    saves_through: Mapping = field(default_factory=dict)
    # the pairs of saves_through on the way from an activation's storage to the op that pays for all of
    # it (charged in the layout it takes it in): where the activation arrives all-gathered on one of them,
    # the module keeps the shard instead (runtime/lowering/regather.py) and the edge corrects the charge
    # (terms.regather_saving)
    payers: frozenset = frozenset()
    # (op, tensor input index) on the way to ops that keep a view of a storage the op making it keeps too (an
    # attention's output) -> that op: the storage is kept once, so they add nothing, unless a layout change on
    # one of these edges hands them a new tensor (terms.copied_kept_bytes)
    also_kept: Mapping = field(default_factory=dict)
    # attention with a boolean mask -> the mask's storage, for the first attention reading a storage no op keeps
    # (a buffer's is counted with the parameters): a ring keeps its mask, where a kernel keeps a copy of its own
    # (terms.ring_saved_correction). Exact where the attentions sharing a mask all run as rings or none does (a
    # stack's layers, which the search ties: capture/blocks.py); where the first does not and a later one does,
    # the prediction misses that one mask
    ring_masks: Mapping = field(default_factory=dict)


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


def activation_model(cap: Captured, hardware, regions=(), cached=frozenset()) -> ActivationModel:
    """Which node pays for each tensor autograd keeps when `cap` trains on `hardware`.

    `regions`: sets of op nodes run under activation checkpointing (one set a
    block). Their ops keep nothing; the checkpoint keeps each region's tensor
    inputs as they arrive (before any redistribution inside the region), so
    each is charged to its producer in the producer's output layout -- unless
    an op before the region keeps that storage already (then it is counted once).
    `cached`: ops of regions whose results a per-op checkpoint caches: each
    keeps its output and the tensors its kernel makes of its own (an
    attention's logsumexp), in its output layout.
    """
    kernels = kernel_family(hardware)
    book = _Keeping(cap, requires_grad(cap), storage_owners(cap))
    region_of = {n: i for i, region in enumerate(regions) for n in region}
    entered = set()
    for node in cap.graph.nodes:
        if node.name in region_of:
            i = region_of[node.name]
            if i not in entered:   # the checkpoint starts here and holds the region's inputs
                entered.add(i)
                book.checkpoint_holds(regions[i])
            if node.name in cached:
                book.caches(node, kernels)
            continue     # recomputed in backward: keeps nothing now
        if node.op == "call_function" and node.name in book.grad:   # else no grad_fn, nothing kept
            book.op_keeps(node, kernels)
    for root, uses in book.kept_by.items():
        book.charge_storage(root, uses)
    kept = {root[0] for root in book.kept_by} | {v[0] for uses in book.kept_by.values() for _, _, v in uses}
    return ActivationModel(kernels, {n: tuple(c) for n, c in book.charges.items()}, frozenset(kept),
                           frozenset(book.keepers), dict(book.saves_through), frozenset(book.payers),
                           dict(book.also_kept), _ring_masks(book, region_of))


def _ring_masks(book: "_Keeping", region_of: dict) -> dict:
    """Attention that keeps its boolean mask if it runs as a ring -> the mask's storage, for the first one (in
    graph order) to read a storage nothing else keeps: the layers of a model share one mask, kept once."""
    out, seen = {}, set(book.kept_by)
    for node in book.cap.graph.nodes:
        args = tensor_args(node) if node.op == "call_function" else []
        if op_name(node) != SDPA or len(args) < 4 or node.name in region_of or node.name not in book.grad:
            continue
        mask = book.meta_of((args[3].name, None))
        root = book.owner.get((args[3].name, None), (args[3].name, None))
        if mask is not None and mask.dtype == torch.bool and root not in seen and book.meta_of(root) is not None \
                and book.cap.info[root[0]].kind not in (PARAM, BUFFER):
            seen.add(root)
            out[node.name] = root
    return out


@dataclass
class _Keeping:
    """The walk of activation_model: what each op keeps, by storage, then who pays for each storage."""
    cap: Captured
    grad: set                                     # nodes whose output requires grad
    owner: dict                                   # value -> the value owning its storage
    charges: dict = field(default_factory=dict)   # node -> [Charge]
    kept_by: dict = field(default_factory=dict)   # storage -> [(keeper, keep, kept value)], in graph order
    keepers: set = field(default_factory=set)
    saves_through: dict = field(default_factory=dict)   # (op, tensor input index) -> saves
    payers: set = field(default_factory=set)            # (op, tensor input index)
    also_kept: dict = field(default_factory=dict)       # (op, tensor input index) -> the storage's maker

    def meta_of(self, value: Value) -> TensorMeta | None:
        m = self.cap.info[value[0]].meta
        return m[value[1]] if isinstance(m, list) and value[1] is not None else first_of(m)

    def reads(self, keeper: fx.Node, keep, value: Value, root: Value) -> list:
        """The (op, tensor input index) edges through which `keeper`'s kept input `value` is `root`'s
        output itself: the keeper's own input, then back along ops that hand their input on unchanged
        (dropout with p = 0, a cast to the same dtype) to the op that reads `root` (a layout change on
        any of them gathers the very tensor autograd keeps). Empty for an op's own output, a piece of a
        tuple, or a value reached through a view: what a kernel keeps of a view may be a copy (matmul
        reshapes a transposed operand into a new tensor), so a gather before it is not what is kept."""
        if not isinstance(keep, Arg) or root[1] is not None or value[1] is not None:
            return []
        edges = [(keeper.name, keep.index)]
        cur = value[0]
        while cur != root[0]:
            node = self.cap.node(cur)
            args = tensor_args(node) if node.op == "call_function" else []
            if not args or not _same_tensor(node, args[0], self.cap, self.owner):
                return []
            edges.append((cur, 0))
            cur = args[0].name
        return edges

    def view_edges(self, keeper: fx.Node, keep, value: Value, root: Value) -> list:
        """The (op, tensor input index) edges from `keeper`'s kept input back along the views of `root` it is:
        a layout change on any of them hands the keeper a new tensor instead of a view of root's storage."""
        edges = [(keeper.name, keep.index)]
        cur = value[0]
        while cur != root[0]:
            node = self.cap.node(cur)
            args = tensor_args(node) if node.op == "call_function" else []
            if not args:
                break
            edges.append((cur, 0))
            cur = args[0].name
        return edges

    def checkpoint_holds(self, region) -> None:
        """A checkpoint keeps its region's tensor inputs, charged to their producers."""
        for value in region_inputs(self.cap, region):
            root = self.owner.get(value, value)
            if self.cap.info[root[0]].kind in (OP, INPUT) and self.meta_of(root) is not None:
                self.kept_by.setdefault(root, []).append((self.cap.node(value[0]), Out(value[1]), value))

    def caches(self, node: fx.Node, kernels: str) -> None:
        """A per-op checkpoint caches the results of `node`: its output, and what its kernel makes itself."""
        own = [k for k in op_keeps(node, self.cap, kernels) if isinstance(k, New) and k.follows is None]
        self.op_keeps(node, kernels, [Out()] + own)

    def op_keeps(self, node: fx.Node, kernels: str, keeps=None) -> None:
        """Charge the tensors `node`'s kernel makes for backward (or `keeps`); note the values it keeps, by
        storage."""
        cap, args = self.cap, tensor_args(node)
        out = first_of(cap.info[node.name].meta)
        spec = None
        for keep in op_keeps(node, cap, kernels) if keeps is None else keeps:
            if isinstance(keep, New):
                if keep.follows is None:
                    cuts = output_cuts(out.ndim, range(keep.dims))
                else:
                    spec = spec or op_spec(node, cap)
                    cuts = input_cuts(spec, keep.follows, out.ndim, range(keep.dims))
                self.charges.setdefault(node.name, []).append(
                    Charge(keep.meta, cuts, f"{op_name(node)} kernel tensor", when=keep.when, unless=keep.unless,
                           follows=keep.follows))
                self.keepers.add(node.name)
                continue
            value = kept_value(node, keep, args, self.grad)
            if value is None:
                continue
            self.keepers.add(node.name)
            root = self.owner.get(value, value)
            if cap.info[root[0]].kind in (PARAM, BUFFER):
                continue           # parameter memory, counted with the parameters
            if self.meta_of(value) is None or self.meta_of(root) is None:
                continue           # not a tensor export could describe
            for edge in self.reads(node, keep, value, root):
                self.saves_through[edge] = self.saves_through.get(edge, 0) + 1
            self.kept_by.setdefault(root, []).append((node, keep, value))

    def charge_storage(self, root: Value, uses: list) -> None:
        """One kept storage, charged once: to its maker if only a piece is kept, else to its first keeper."""
        cap = self.cap
        whole = _bytes_of(self.meta_of(root))
        partial = any(_bytes_of(self.meta_of(v)) != whole for _, _, v in uses)
        if not partial and isinstance(uses[0][1], Out):
            # the op keeps its own output: the storage stays, whatever its other keepers read it through
            for n, k, v in uses[1:]:
                if isinstance(k, Arg):
                    self.also_kept.update(dict.fromkeys(self.view_edges(n, k, v, root), root[0]))
        if partial and cap.info[root[0]].kind == OP:
            # a piece keeps the whole storage alive: its maker pays for all of it
            m = self.meta_of(root)
            self.charges.setdefault(root[0], []).append(
                Charge(m, output_cuts(m.ndim, range(m.ndim)), f"{root[0]} (viewed)"))
            return
        node, keep, value = uses[0]
        out = first_of(cap.info[node.name].meta)
        m = self.meta_of(value)
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
            elif not partial and not keep.unless:
                self.payers.update(self.reads(node, keep, value, root))
        self.charges.setdefault(node.name, []).append(
            Charge(self.meta_of(root) if partial else m, cuts, f"{value[0]} kept by {node.name}",
                   unless=keep.unless if isinstance(keep, Arg) else frozenset(), view=view))


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
