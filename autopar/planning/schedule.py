"""Schedule: what the runtime does beyond the per-node layouts, decided when the plan is made.

A plan names a layout for every node; how the module then groups its
collectives is a decision too, and it changes what runs: which weights share
a gradient bucket's all-reduce, which ZeRO weights share a reduce-scatter,
which FSDP weights one all-gather brings, which gathered activations are kept
as their shard and gathered again in backward. The cost model prices those
groupings; this module writes them down, so the runtime reads them from the
plan (and a plan saved as JSON runs the same on another autopar version)
instead of deriving them again from the cost model at run time.

`schedule_of` calls the cost model's own functions (cost/buckets.py,
cost/layer_groups.py, cost/activations.py), so the schedule is the grouping the
plan's collectives price. Weights are named by FQN; activations by the
captured graph's node names, which the other mode's graph shares
(api._other_mode checks the structure).

What the rewriter does beyond the layouts is the schedule's `lowering` (lowering.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..capture.export import INPUT, PARAM, Captured
from ..cost.activations import activation_model
from ..cost.buckets import assign_buckets, deferred_axes, params_by_first_use, partial_gradients, zero_buckets
from ..cost.layer_groups import group_key, groupable
from ..cost.precision import precision_of
from ..cost.terms import first_meta
from ..sharding.op_spec import tensor_args
from ..sharding.placement import local_shape, numel
from ..sharding.redistribute import plan_steps
from .lowering import Lowering, lowering_of


@dataclass(frozen=True)
class Bucket:
    """Weights whose gradients one flat collective reduces: on `axes` (names), in the order backward makes them."""
    axes: tuple
    weights: tuple


@dataclass(frozen=True)
class LayerGroup:
    """FSDP weights gathered by one all-gather on `axis` and reduce-scattered by one reduce-scatter, in `dtype`;
    their reduce-scattered gradient is then summed over `sum_axes` (cost/layer_groups.py)."""
    axis: str
    dtype: str
    sum_axes: tuple
    weights: tuple


@dataclass(frozen=True)
class Schedule:
    # pipeline coordinate (0 when not pipelined) -> the gradient buckets of the weights that device holds, in
    # launch order (runtime/reduction/grad_buckets.py)
    grad_buckets: dict = field(default_factory=dict)
    # ZeRO level (1, 2) -> its buckets, one axis each, in launch order (runtime/reduction/zero_buckets.py)
    zero_buckets: dict = field(default_factory=dict)
    # in the order forward first gathers them (runtime/reduction/layer_groups.py); none on a pipeline, whose
    # stages hold only their own weights
    layer_groups: tuple = ()
    # (op node, tensor input index): that input is gathered whole for an op that keeps it; the runtime keeps
    # the shard and gathers it again in backward (runtime/lowering/regather.py)
    regathered: frozenset = frozenset()
    # the pipeline stages the buckets were made for (stage_cut); () when not pipelined
    stage_cut: tuple = ()
    # what the rewriter does to the captured graph (Lowering); None in a plan of JSON format 3 or older, made
    # when the module is built (api._with_schedule)
    lowering: Lowering | None = None

    def layer_group_of(self, fqn: str, axis: str, dtype: str, sum_axes: tuple) -> int | None:
        """Index of the group that gathers `fqn` with that signature, None if the plan groups it nowhere."""
        for k, g in enumerate(self.layer_groups):
            if fqn in g.weights and (g.axis, g.dtype, g.sum_axes) == (axis, dtype, tuple(sum_axes)):
                return k
        return None

    def to_dict(self) -> dict:
        return {"grad_buckets": {str(c): [[list(b.axes), list(b.weights)] for b in bs]
                                 for c, bs in self.grad_buckets.items()},
                "zero_buckets": {str(lvl): [[list(b.axes), list(b.weights)] for b in bs]
                                 for lvl, bs in self.zero_buckets.items()},
                "layer_groups": [{"axis": g.axis, "dtype": g.dtype, "sum_axes": list(g.sum_axes),
                                  "weights": list(g.weights)} for g in self.layer_groups],
                "regathered": sorted([op, i] for op, i in self.regathered),
                "stage_cut": [list(c) for c in self.stage_cut],
                **({"lowering": self.lowering.to_dict()} if self.lowering is not None else {})}

    @staticmethod
    def from_dict(d: dict) -> "Schedule":
        def buckets(items):
            return tuple(Bucket(tuple(axes), tuple(weights)) for axes, weights in items)
        return Schedule({int(c): buckets(bs) for c, bs in d["grad_buckets"].items()},
                        {int(lvl): buckets(bs) for lvl, bs in d["zero_buckets"].items()},
                        tuple(LayerGroup(g["axis"], g["dtype"], tuple(g["sum_axes"]), tuple(g["weights"]))
                              for g in d["layer_groups"]),
                        frozenset((op, i) for op, i in d["regathered"]),
                        tuple(tuple(c) for c in d.get("stage_cut", ())),
                        _lowering(d.get("lowering")))


def _lowering(d: dict | None) -> Lowering | None:
    """The Lowering a schedule's JSON holds; None where it has none, or one written before the lowering recorded
    its ops and layout changes (format 4 then): the module makes it again when built (api._with_lowering)."""
    return Lowering.from_dict(d) if d is not None and "layout_changes" in d else None


def schedule_of(cap: Captured, plan, grad_nodes: set, saved=None) -> Schedule:
    """The schedule of `plan` (a Plan, or anything with its fields) on its captured graph `cap`; `grad_nodes`:
    the nodes a gradient flows through (cost/terms.needs_grad); `saved`: cap's activation model on the plan's
    hardware (cost/activations.activation_model), made here when not given."""
    return Schedule(_grad_buckets(cap, plan, grad_nodes), _zero_buckets(cap, plan, grad_nodes),
                    _layer_groups(cap, plan, grad_nodes), _regathered(cap, plan, saved), stage_cut(plan.pipeline),
                    lowering_of(cap, plan, grad_nodes))


def stage_cut(pipeline) -> tuple:
    """(first node, number of nodes) per stage of a PipelinePlan (() for None): a schedule made for other
    stages does not fit this pipeline (a plan whose stages were edited after planning)."""
    if pipeline is None:
        return ()
    return tuple((s.nodes[0] if s.nodes else "", len(s.nodes)) for s in pipeline.stages)


def _axis_sizes(plan) -> dict:
    return dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))


def _grad_buckets(cap: Captured, plan, grad_nodes: set) -> dict:
    """Per pipeline coordinate, the buckets of the weights whose data-axis gradient the graph leaves partial
    (cost/buckets.deferred_axes), over the weights that device holds, in the order backward makes their
    gradients (the reverse of first use); sized by the local weight in its reduce dtype, as priced."""
    policy, names = precision_of(plan.precision), plan.mesh.axis_names
    held = {0: None} if plan.pipeline is None else pipeline_weights(cap, plan.pipeline)
    deferred = list(reversed(deferred_axes(cap, plan.node_strategies, grad_nodes).items()))
    out = {}
    for coord, weights in held.items():
        entries = []
        for node, axes in deferred:
            info = cap.info[node]
            if weights is not None and info.target_name not in weights:
                continue
            meta = first_meta(info.meta)
            itemsize = policy.resolve(cap.param_dtypes.get(info.target_name, meta.dtype)).reduce.itemsize
            n = numel(local_shape(meta.hint, plan.node_strategies[node].output, plan.mesh.axis_sizes))
            entries.append((info.target_name, n, tuple(names[a] for a in axes), itemsize, itemsize))
        out[coord] = tuple(Bucket(axes, tuple(ws)) for axes, _, ws in assign_buckets(entries, plan.bucket_bytes))
    return out


def _zero_buckets(cap: Captured, plan, grad_nodes: set) -> dict:
    """ZeRO level -> its buckets (cost/buckets.zero_buckets), sized as priced: the local weight, its gradient
    in the reduce dtype. A pipelined plan prices its stages' ZeRO reductions one weight at a time
    (search/stage_costs.py): none."""
    if plan.pipeline is not None:
        return {}
    policy, sizes = precision_of(plan.precision), {}
    for node, s in plan.node_strategies.items():
        info = cap.info.get(node)
        if info is None or info.kind != PARAM or not s.zero or node not in grad_nodes:
            continue
        meta = first_meta(info.meta)
        p = policy.resolve(cap.param_dtypes.get(info.target_name, meta.dtype))
        sizes[info.target_name] = (numel(local_shape(meta.hint, s.output, plan.mesh.axis_sizes)),
                                   p.reduce.itemsize, p.master.itemsize)
    order = params_by_first_use(cap)
    return {level: tuple(Bucket((axis,), tuple(ws)) for axis, ws in
                         zero_buckets(order, plan.param_zero, sizes, plan.bucket_bytes, level, _axis_sizes(plan)))
            for level in (1, 2)}


def _layer_groups(cap: Captured, plan, grad_nodes: set) -> tuple:
    """The FSDP layer groups (cost/layer_groups.group_key) of the weights whose one layout change is a
    groupable gather, in the order forward first reads them; as the rewriter meets them."""
    if plan.pipeline is not None:
        return ()
    strategies, names = plan.node_strategies, plan.mesh.axis_names
    policy = precision_of(plan.precision)
    deferred = partial_gradients(cap, strategies, grad_nodes)
    groups: dict = {}
    for node in cap.graph.nodes:
        s = strategies.get(node.name)
        if node.op != "call_function" or s is None:
            continue
        for i, a in enumerate(tensor_args(node)):
            info = cap.info.get(a.name)
            if info is None or info.kind != PARAM or a.name not in strategies:
                continue
            src, dst = strategies[a.name].output, s.inputs[i]
            grads = a.name in grad_nodes
            gp = tuple(sorted(set(s.grad_partial(i)) | set(deferred.get(node.name, ())))) if grads else ()
            keep = (tuple(strategies[a.name].zero_axes) if grads else ()) + deferred.get(a.name, ())
            if tuple(src) == tuple(dst) and set(gp) == set(keep):
                continue
            steps = plan_steps(tuple(src), tuple(dst), gp, keep_partial=keep)
            if not groupable(steps):
                continue
            key = group_key(info.target_name, steps, str(_gathered_dtype(cap, info, policy)))
            _, axis, dtype, sum_axes = key
            members = groups.setdefault(key, (axis, dtype, sum_axes, []))[3]
            if info.target_name not in members:
                members.append(info.target_name)
    return tuple(LayerGroup(names[axis], dtype, tuple(names[x] for x in sum_axes), tuple(ws))
                 for axis, dtype, sum_axes, ws in groups.values())


def _gathered_dtype(cap: Captured, info, policy):
    """The dtype a weight's gather moves: the compute dtype it is cast to under mixed precision
    (runtime/lowering/rewrite.weight_casts), else its captured one."""
    meta = first_meta(info.meta)
    own = cap.param_dtypes.get(info.target_name, meta.dtype)
    if own.is_floating_point:
        p = policy.resolve(own)
        if p.compute != p.master:
            return p.compute
    return meta.dtype


def _regathered(cap: Captured, plan, saved) -> frozenset:
    """The (op, input index) pairs whose input autograd keeps, when the plan re-gathers activations."""
    if not plan.regather_activations:
        return frozenset()
    saves = (saved or activation_model(cap, plan.hardware)).saves_through
    return frozenset(edge for edge, count in saves.items() if count)


def pipeline_weights(cap: Captured, pipeline) -> dict:
    """Pipeline coordinate -> the FQNs of the weights its stages read: a weight goes to every stage that reads
    it, directly or through nodes that read no activation (a transpose, a cast) or hold no tensor, as
    runtime/pipeline/stages.py cuts the local graph (a device whose stages hold other weights than these is
    refused there: runtime/reduction/grad_buckets.check_bucketed)."""
    stage_of, num_devices = pipeline.stage_of(), pipeline.num_stages // pipeline.stages_per_device
    unowned: dict = {}   # node no stage owns -> the weights it reads
    out = {c: set() for c in range(num_devices)}
    for node in cap.graph.nodes:
        info = cap.info.get(node.name)
        reads = set().union(*(unowned.get(a.name, set()) for a in node.all_input_nodes))
        if node.op == "placeholder":
            if info is not None and info.kind != INPUT:
                unowned[node.name] = {info.target_name} if info.kind == PARAM else set()
        elif node.op == "get_attr":
            unowned[node.name] = set()
        elif node.op == "output":
            out[(pipeline.num_stages - 1) % num_devices] |= reads
        elif _holds_no_tensor(cap, node) or all(a.name in unowned for a in node.all_input_nodes):
            unowned[node.name] = reads
        elif node.name in stage_of:
            out[stage_of[node.name] % num_devices] |= reads
    return out


def _holds_no_tensor(cap: Captured, node) -> bool:
    info = cap.info.get(node.name)
    return info is not None and info.meta is None and node.op == "call_function" and not isinstance(
        node.meta.get("val"), (torch.Tensor, list, tuple))
