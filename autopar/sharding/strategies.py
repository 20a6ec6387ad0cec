"""Sharding: every candidate strategy of every node on a given mesh.

A Strategy says which placement each tensor input must have and which
placement the output gets. Ops get theirs from their OpSpec (rules.py), one
mesh axis at a time, combined over axes and filtered by divisibility.
Placeholders (parameters, inputs) get "storage" placements: where the tensor
lives between steps.
"""
from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass

import torch.fx as fx

from ..capture.export import INPUT, OP, OUTPUT, PARAM, Captured, TensorMeta
from ..errors import UnsupportedOpWarning
from ..mesh import MeshSpec
from .op_spec import OpSpec, op_name, tensor_args
from .placement import P, Placements, R, S, can_split_unevenly, dim_factor, local_shape, numel, uneven_dims
from .rules import ring_fits, rule_for


@dataclass(frozen=True)
class Strategy:
    inputs: tuple       # required Placements of each tensor input (tensor_args order)
    output: Placements  # placement of the output (of every element of a tuple output)
    # parameters only, ZeRO: the weight is stored whole (R) on `zero_axes`, but its optimizer
    # state (zero=1), and its gradient too (zero=2), is split there, as a flat 1/n slice per rank
    zero: int = 0
    zero_axes: tuple = ()

    def split_axes(self) -> frozenset:
        """Axes over which this op runs split: the axes where some operand is not R."""
        axes = set()
        for pl in self.inputs + (self.output,):
            for a, p in enumerate(pl):
                if p != R:
                    axes.add(a)
        return frozenset(axes)

    def grad_partial(self, i: int) -> tuple:
        """Axes on which the gradient of input i arrives as partial sums (see redistribute.py)."""
        return tuple(sorted(a for a in self.split_axes() if self.inputs[i][a] == R))


@dataclass
class NodeStrategies:
    node: str
    kind: str
    strategies: list
    replicated_fallback: bool = False   # no rule: replicated, with a warning


def _axis_options(spec: OpSpec, num_in: int):
    """Per-axis (input placements, output placement) options of one OpSpec."""
    opts = [((R,) * num_in, R)]
    if spec.replicate_only:
        return opts
    letters = []
    for s in spec.inputs + (spec.output,):
        for c in s:
            if c not in spec.no_shard and c not in letters:
                letters.append(c)
    for c in letters:
        out = S(spec.output.index(c)) if c in spec.output else P
        ins = []
        for i, s in enumerate(spec.inputs):
            if c in s:
                ins.append(S(s.index(c)))
            elif out == P and i in spec.additive:
                ins.append(P)
            else:
                ins.append(R)
        opts.append((tuple(ins), out))
    if spec.ring:
        rows, keys = spec.ring
        ins = tuple(S(s.index(rows)) if rows in s else S(s.index(keys)) if keys in s else R for s in spec.inputs)
        opts.append((ins, S(spec.output.index(rows))))
    partial_sources = [(i,) for i in spec.linear] or ([tuple(spec.additive)] if spec.additive else [])
    for src in partial_sources:
        ins = tuple(P if (i in src or i in spec.additive) else R for i in range(num_in))
        opts.append((ins, P))
    return list(dict.fromkeys(opts))


def _divides(meta: TensorMeta, placements: Placements, axis_sizes) -> bool:
    for d, size in enumerate(meta.hint):
        f = dim_factor(placements, d, axis_sizes)
        if f > 1 and size % f:
            return False
    return True


def _combine(per_axis: list, num_in: int) -> list:
    out = []
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(num_in))
        outp = tuple(c[1] for c in combo)
        out.append(Strategy(ins, outp))
    return out


def _metas(meta) -> list:
    return meta if isinstance(meta, list) else [meta]


def _first_meta(meta):
    return _metas(meta)[0] if meta is not None else None


def op_strategies(node: fx.Node, cap: Captured, mesh: MeshSpec) -> NodeStrategies:
    info = cap.info[node.name]
    args = tensor_args(node)
    in_metas = [_metas(cap.info[a.name].meta)[0] if cap.info[a.name].meta is not None else None for a in args]
    out_meta = _metas(info.meta)[0]
    rule = rule_for(node)
    fallback = False
    spec = None
    if rule is not None and all(m is not None for m in in_metas):
        if node.target is operator.getitem:
            in_metas = [_metas(cap.info[args[0].name].meta)[node.args[1]]]
        try:
            spec = rule(node, in_metas, out_meta)
        except Exception:  # a rule that cannot read this call's arguments: stay correct, replicate
            spec = None
        if spec is not None and len(spec.inputs) != len(args):
            spec = None  # a rule that does not describe every tensor input cannot be trusted
    if spec is None:
        fallback = rule is None
        spec = OpSpec(tuple("" for _ in args), "", replicate_only=True)
    # an axis of one rank splits nothing: a layout other than R there would be R under another name, and
    # each change between the two a collective over one rank (a copy, at best)
    per_axis = [_axis_options(spec, len(args)) if size > 1 else [((R,) * len(args), R)]
                for size in mesh.axis_sizes]
    strategies = []
    for s in _combine(per_axis, len(args)):
        if not _divides(out_meta, s.output, mesh.axis_sizes):
            continue
        if not all(_divides(m, pl, mesh.axis_sizes) for m, pl in zip(in_metas, s.inputs)):
            continue
        if spec.ring and not ring_fits(node, in_metas[0].hint[-2], s, mesh.axis_sizes):
            continue
        strategies.append(s)
    return NodeStrategies(node.name, OP, strategies, fallback)


def batch_derived(cap: Captured, batch_dim: int = 0) -> set:
    """Names of the nodes computed from a user input with a batch dim (and those inputs): the activations.
    The rest are computed from the weights (and constants) alone, whose dim 0 is no batch."""
    out = set()
    for n in cap.graph.nodes:
        info = cap.info.get(n.name)
        if n.op == "placeholder":
            meta = _first_meta(info.meta) if info is not None else None
            if info is not None and info.kind == INPUT and meta is not None and meta.ndim > batch_dim:
                out.add(n.name)
        elif any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def batch_outputs(node: fx.Node, cap: Captured, batch_dim: int = 0) -> tuple[set, set]:
    """(names of the outputs that carry the batch along `batch_dim`, names of the other outputs computed
    from the batch). An output carries the batch when it is computed from a user input with a batch dim
    and is as long as the batch there. Any other output -- a function of the weights alone (a
    regularizer), a statistic over the batch (a mean over dim 0), a scalar loss -- is one value for the
    whole batch: split along its dim 0 it would be cut where no batch is, and its gradient scaled as a
    shard's."""
    from_batch = batch_derived(cap, batch_dim)
    sizes = {_first_meta(cap.info[n].meta).hint[batch_dim] for n in from_batch if cap.info[n].kind == INPUT}
    carry, other = set(), set()
    for a in tensor_args(node):
        if a.name not in from_batch:
            continue
        meta = _first_meta(cap.info[a.name].meta)
        if meta is not None and meta.ndim > batch_dim and meta.hint[batch_dim] in sizes:
            carry.add(a.name)
        else:
            other.add(a.name)
    return carry, other


def placeholder_strategies(node: fx.Node, cap: Captured, mesh: MeshSpec, batch_dim: int = 0) -> NodeStrategies:
    """Storage placements. Parameters may split any dim, evenly or not (padded, placement.py: they are
    gathered before use, so no op sees an uneven shard); user inputs only their batch dim, evenly."""
    info = cap.info[node.name]
    meta = info.meta
    n = mesh.num_axes
    if not isinstance(meta, TensorMeta):
        return NodeStrategies(node.name, info.kind, [Strategy((), (R,) * n)])
    if info.kind == PARAM:
        choices = [R] + [S(d) for d in range(meta.ndim)]
    elif info.kind == INPUT and meta.ndim > 0:
        choices = [R, S(batch_dim)]
    else:
        choices = [R]
    out = []
    for combo in itertools.product(*[choices if size > 1 else [R] for size in mesh.axis_sizes]):
        if _divides(meta, combo, mesh.axis_sizes) or (
                info.kind == PARAM and can_split_unevenly(meta.hint, combo, mesh.axis_sizes)):
            out.append(Strategy((), tuple(combo)))
            if info.kind == PARAM and meta.dtype.is_floating_point:
                out += zero_variants(combo, meta, mesh)
    return NodeStrategies(node.name, info.kind, out)


def zero_variants(storage: Placements, meta: TensorMeta, mesh: MeshSpec) -> list:
    """ZeRO-1/2 over every non-empty set of axes that keep the weight whole.

    The state is a flat slice of the local tensor: over one axis, padded where
    that axis's size does not divide the element count (torch.chunk's layout);
    over several, the count must divide by the product of their sizes.
    """
    whole = [a for a, p in enumerate(storage) if p == R and mesh.axis_sizes[a] > 1]
    local = numel(local_shape(meta.hint, storage, mesh.axis_sizes))
    out = []
    for k in range(1, len(whole) + 1):
        for axes in itertools.combinations(whole, k):
            n = 1
            for a in axes:
                n *= mesh.axis_sizes[a]
            # several axes: every rank's flat tensor must divide (an uneven split on another axis leaves
            # some ranks a shorter one than `local`, the largest)
            if len(axes) == 1 or (local % n == 0 and not uneven_dims(meta.hint, storage, mesh.axis_sizes)):
                out += [Strategy((), tuple(storage), level, axes) for level in (1, 2)]
    return out


def output_strategies(node: fx.Node, cap: Captured, mesh: MeshSpec, batch_dim: int = 0) -> NodeStrategies:
    """What the module returns: each output that carries the batch (batch_outputs) split along the batch dim
    over the batch axes; the others whole on every rank."""
    args = tensor_args(node)
    batched, _ = batch_outputs(node, cap, batch_dim)
    out = []
    for combo in itertools.product(*[[R, S(batch_dim)] if size > 1 else [R] for size in mesh.axis_sizes]):
        ins = []
        ok = True
        for a in args:
            m = _metas(cap.info[a.name].meta)[0]
            pl = tuple(p if a.name in batched else R for p in combo)
            if not _divides(m, pl, mesh.axis_sizes):
                ok = False
            ins.append(pl)
        if ok:
            out.append(Strategy(tuple(ins), tuple(combo)))
    return NodeStrategies(node.name, OUTPUT, out)


def all_strategies(cap: Captured, mesh: MeshSpec, same_as: dict | None = None) -> dict[str, NodeStrategies]:
    """Strategies of every node that carries tensors; warns once per op without a rule.

    `same_as`: node -> an earlier node known to be the same op on the same
    shapes (a repeated block, blocks.py), whose strategies it shares.
    """
    result, unknown = {}, {}
    same_as = same_as or {}
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        first = same_as.get(node.name)
        if first in result:
            ns = result[first]
            result[node.name] = NodeStrategies(node.name, ns.kind, ns.strategies, ns.replicated_fallback)
            if ns.replicated_fallback:
                unknown.setdefault(op_name(node), []).append(info.module_path or "<root>")
        elif node.op == "placeholder":
            result[node.name] = placeholder_strategies(node, cap, mesh)
        elif node.op == "output":
            result[node.name] = output_strategies(node, cap, mesh)
        elif info.meta is not None:
            ns = op_strategies(node, cap, mesh)
            result[node.name] = ns
            if ns.replicated_fallback:
                unknown.setdefault(op_name(node), []).append(info.module_path or "<root>")
    for op, paths in unknown.items():
        warnings.warn(
            f"autopar has no sharding rule for {op} (used in {', '.join(sorted(set(paths)))}); "
            "it runs replicated, which is correct but may cost communication. "
            "Add a rule in autopar/sharding/rules.py to let it be split.", UnsupportedOpWarning, stacklevel=3)
    return result
