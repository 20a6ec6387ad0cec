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

The rest of what the rewriter does beyond the layouts is decided here too
(`Lowering`, made by `lowering_of`): which gradients stay partial for the
buckets and the gradient scales, the weights cast for mixed precision, which
weight uses join an FSDP layer group, the recomputed blocks, how each op runs
on a rank's shards (sharding/local_ops.LocalOp) and the steps of each layout
change. The runtime reads all of it and imports nothing of cost/ or search/
(tests/test_layering.py), nor asks sharding/ again what the plan implies.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

import torch

from ..capture.export import INPUT, PARAM, Captured
from ..cost.activations import activation_model
from ..cost.buckets import (assign_buckets, bucket_grad_scale, deferred_axes, output_grad_scale,
                            params_by_first_use, partial_gradients, zero_buckets)
from ..cost.checkpointing import SavePolicy, checkpointable_stacks
from ..cost.layer_groups import group_key, groupable, sums_gradient
from ..cost.precision import precision_of
from ..cost.terms import first_meta
from ..errors import PlanError
from ..sharding.local_ops import PLAIN, LocalOp, Ring, VocabLookup, VocabLoss, local_op
from ..sharding.op_spec import op_arg, tensor_args
from ..sharding.placement import R, gathered_size, is_shard, local_shape, numel, shard_dim
from ..sharding.redistribute import Step, UnsupportedRedistribution, gathers_again, plan_steps


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
class Region:
    """One block the runtime runs under activation checkpointing: block `index` of the stack at `path`, its
    captured ops `nodes`; `policy`: the per-op SavePolicy it caches by (cost/checkpointing.py), None when
    every op is recomputed (runtime/lowering/recompute.py)."""
    path: str
    index: int
    nodes: tuple
    policy: SavePolicy | None = None


@dataclass(frozen=True)
class LayoutChange:
    """One layout change the rewriter inserts (a RedistributeModule): its `steps` (sharding/redistribute.plan_steps);
    for a weight, per step the length of the dim it splits or gathers, whole along its axis (a weight's storage
    may split a dim unevenly: placement.py), else None; whether backward would gather what it gathers again
    rather than keep it, by the rule for a weight and by the one for an activation (redistribute.gathers_again)."""
    steps: tuple
    wholes: tuple | None
    weight_gathers_again: bool
    activation_gathers_again: bool


@dataclass(frozen=True)
class Lowering:
    """What the rewriter (runtime/lowering/rewrite.py) does to one captured graph beyond the per-node layouts,
    decided here from the graph and the chosen strategies (lowering_of), so the runtime reads it and
    derives nothing from the cost model, nor asks the rules again. `made_for`: the digest (lowering_key) of what it was made from: the
    plan's layouts, precision, recomputed stacks, hardware and pipeline, and the graph's frozen weights."""
    # node -> mesh axes (indices) on which its gradient is left partial for the gradient buckets to reduce:
    # weights first, in order of first use, then activations (cost/buckets.partial_gradients)
    partial_gradients: dict = field(default_factory=dict)
    # the outputs' gradient factor the buckets apply instead of the outputs (cost/buckets.bucket_grad_scale)
    grad_scale: float = 1.0
    # per tensor output, the factor on its gradient (cost/buckets.output_grad_scale)
    output_grad_scales: tuple = ()
    # parameter node -> (compute dtype, reduce dtype) names ("torch.bfloat16") of a weight stored in the master
    # dtype and cast where it is used (mixed precision, cost/precision.py)
    casts: dict = field(default_factory=dict)
    # (reader, tensor input index) -> (gather axis, dtype, summed axes) of a weight use whose layout change joins
    # its FSDP layer group (cost/layer_groups.groupable); the reader "output" for the graph's outputs
    grouped: dict = field(default_factory=dict)
    # the checkpointed blocks, in the order of plan.checkpointed's stacks, then block
    recomputed: tuple = ()
    made_for: str = ""
    # call_function node -> how it runs on a rank's shards (sharding/local_ops.LocalOp), for each op that is more
    # than itself on its local tensors
    ops: dict = field(default_factory=dict)
    # (producer, layout, gradient-partial axes) -> the LayoutChange that gives every reader asking for it the
    # producer in that layout (runtime/lowering/rewrite._Rewriter.redistribute's key)
    layout_changes: dict = field(default_factory=dict)
    # linear node run in float8 -> (recipe, splits): splits are the mesh axes (indices) that split (its
    # activation's rows, its in_features), (its weight's out_features, in_features), (its output gradient's rows,
    # out_features): what each amax is reduced over (cost/float8.py; runtime/lowering/float8.py)
    float8: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"partial_gradients": [[n, list(axes)] for n, axes in self.partial_gradients.items()],
                "grad_scale": self.grad_scale, "output_grad_scales": list(self.output_grad_scales),
                "casts": {n: list(c) for n, c in self.casts.items()},
                "grouped": [[op, i, axis, dtype, list(sums)] for (op, i), (axis, dtype, sums) in self.grouped.items()],
                "recomputed": [{"path": r.path, "index": r.index, "nodes": list(r.nodes),
                                "policy": None if r.policy is None else
                                {"matmuls": list(r.policy.matmuls), "attentions": list(r.policy.attentions),
                                 "cached": list(r.policy.cached)}} for r in self.recomputed],
                "made_for": self.made_for,
                "ops": {n: _local_op_dict(op) for n, op in self.ops.items()},
                "layout_changes": [_layout_change_dict(key, c) for key, c in self.layout_changes.items()],
                **({"float8": [[n, recipe, [[list(a) for a in pair] for pair in splits]]
                                for n, (recipe, splits) in self.float8.items()]} if self.float8 else {})}

    @staticmethod
    def from_dict(d: dict) -> "Lowering":
        def policy(p):
            return None if p is None else SavePolicy(tuple(p["matmuls"]), tuple(p["attentions"]), tuple(p["cached"]))
        return Lowering({n: tuple(axes) for n, axes in d["partial_gradients"]}, float(d["grad_scale"]),
                        tuple(float(x) for x in d["output_grad_scales"]),
                        {n: tuple(c) for n, c in d["casts"].items()},
                        {(op, i): (axis, dtype, tuple(sums)) for op, i, axis, dtype, sums in d["grouped"]},
                        tuple(Region(r["path"], r["index"], tuple(r["nodes"]), policy(r["policy"]))
                              for r in d["recomputed"]),
                        d["made_for"], ops={n: _read_local_op(op) for n, op in d["ops"].items()},
                        layout_changes=dict(_read_layout_change(c) for c in d["layout_changes"]),
                        float8={n: (recipe, tuple(tuple(tuple(a) for a in pair) for pair in splits))
                                for n, recipe, splits in d.get("float8", ())})


# LocalOp's fields that are records of their own (a dict each in JSON)
_OP_RECORDS = {"ring": Ring, "vocab_loss": VocabLoss, "vocab_lookup": VocabLookup}


def _local_op_dict(op: LocalOp) -> dict:
    """The fields of `op` that are not a plain op's (PLAIN), its records as dicts."""
    out = {}
    for f in fields(op):
        value = getattr(op, f.name)
        if value != getattr(PLAIN, f.name):
            out[f.name] = asdict(value) if f.name in _OP_RECORDS else value
    return out


def _read_local_op(d: dict) -> LocalOp:
    """The LocalOp of _local_op_dict's dict."""
    def tupled(v):   # JSON's lists back as the tuples the records hold
        return tuple(v) if isinstance(v, list) else v
    given = {}
    for name, value in d.items():
        given[name] = (_OP_RECORDS[name](**{k: tupled(v) for k, v in value.items()}) if name in _OP_RECORDS
                       else tupled(value))
    return LocalOp(**given)


def _layout_change_dict(key: tuple, c: LayoutChange) -> dict:
    producer, layout, grad_partial = key
    return {"producer": producer, "layout": list(layout), "grad_partial": list(grad_partial),
            "steps": [[s.axis, s.src, s.dst, s.grad_src, s.grad_dst, list(s.before), list(s.after)] for s in c.steps],
            "wholes": None if c.wholes is None else list(c.wholes),
            "gathers_again": [c.weight_gathers_again, c.activation_gathers_again]}


def _read_layout_change(d: dict) -> tuple:
    """(key, LayoutChange) of _layout_change_dict's dict."""
    steps = tuple(Step(axis, src, dst, grad_src, grad_dst, tuple(before), tuple(after))
                  for axis, src, dst, grad_src, grad_dst, before, after in d["steps"])
    wholes = None if d["wholes"] is None else tuple(d["wholes"])
    return ((d["producer"], tuple(d["layout"]), tuple(d["grad_partial"])),
            LayoutChange(steps, wholes, *d["gathers_again"]))


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


def lowering_of(cap: Captured, plan, grad_nodes: set) -> Lowering:
    """What the rewriter does to `cap` under `plan` beyond the layouts (Lowering); `grad_nodes`: cap's nodes a
    gradient flows through (cost/terms.needs_grad). Raises PlanError where the plan checkpoints a stack `cap`
    does not have, asks for a layout change no steps make, or runs as a ring an attention that draws dropout."""
    deferred = partial_gradients(cap, plan.node_strategies, grad_nodes)
    out = next(n for n in cap.graph.nodes if n.op == "output")
    layouts = plan.node_strategies["output"].inputs
    scales = tuple(output_grad_scale(layouts[i], plan.mesh.axis_sizes) for i, _ in enumerate(tensor_args(out)))
    casts = weight_casts(cap, plan)
    uses = list(_uses(cap, plan, grad_nodes, deferred))
    changes = layout_changes(cap, plan, uses, casts)
    return Lowering(deferred, bucket_grad_scale(cap, plan, grad_nodes, deferred), scales,
                    {n: (str(c), str(r)) for n, (c, r) in casts.items()},
                    _grouped_uses(cap, plan, uses, changes, casts), recomputed_regions(cap, plan),
                    lowering_key(cap, plan), ops=local_ops_of(cap, plan), layout_changes=changes,
                    float8=float8_uses(cap, plan))


def float8_uses(cap: Captured, plan) -> dict:
    """Linear node -> (recipe, splits) for each linear the plan runs in float8 (plan.float8_linears; Lowering's
    float8 says what splits holds). Its output's gradient arrives in the output's layout and whole-valued (the
    plan leaves no float8 linear's gradient partial: planning/result.float8_linears)."""
    if not plan.float8_linears:
        return {}
    recipe = precision_of(plan.precision).float8.recipe_name

    def split(placements, inner_dim):
        """(axes splitting another dim, axes splitting `inner_dim`) of a tensor laid out in `placements`."""
        inner = tuple(a for a, p in enumerate(placements) if is_shard(p) and shard_dim(p) == inner_dim)
        return tuple(a for a, p in enumerate(placements) if is_shard(p) and a not in inner), inner

    out = {}
    for name in plan.float8_linears:
        s = plan.node_strategies[name]
        last = len(first_meta(cap.info[name].meta).hint) - 1   # the activation, the output: [..., K], [..., N]
        out[name] = (recipe, (split(s.inputs[0], last), split(s.inputs[1], 1), split(s.output, last)))
    return out


def lowering_key(cap: Captured, plan) -> str:
    """A digest of what lowering_of reads besides the graph's ops: the plan's layouts, precision, recomputed
    stacks, hardware, mesh and whether it is pipelined, and `cap`'s frozen weights. A plan edited after
    planning (a layout forced, a weight frozen since) has another, and gets its Lowering made again
    (api._with_lowering), as the runtime once derived it from whatever it was given."""
    made_from = [sorted([n, [list(map(list, s.inputs)), list(s.output), s.zero, list(s.zero_axes)]]
                        for n, s in plan.node_strategies.items()),
                 plan.precision, dict(plan.checkpointed), plan.hardware, list(plan.mesh.axis_names),
                 list(plan.mesh.axis_sizes), plan.pipeline is not None, sorted(cap.frozen_params)]
    if plan.float8_linears:   # (absent otherwise: the digest of a plan without float8 is as before)
        made_from.append(list(plan.float8_linears))
    return hashlib.sha256(json.dumps(made_from, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weight_casts(cap: Captured, plan) -> dict:
    """Parameter node -> (compute dtype, reduce dtype) for each weight the policy stores in a master dtype
    and casts where it is used (cost/precision.py); empty without mixed precision."""
    policy = precision_of(plan.precision)
    out = {}
    for name, info in cap.info.items():
        if info.kind != PARAM:
            continue
        own = cap.param_dtypes.get(info.target_name, info.meta.dtype)
        if not own.is_floating_point:
            continue
        p = policy.resolve(own)
        if p.compute != p.master:
            out[name] = (p.compute, p.reduce)
    return out


def _uses(cap: Captured, plan, grad_nodes: set, deferred: dict):
    """(use, producer, its layout, the layout wanted, gradient-partial axes, axes kept partial) for each tensor the
    rewriter lays out for a reader (runtime/lowering/rewrite._Rewriter.redistribute, which reasons the same way):
    `use` (op, tensor input index) for an op with a strategy, ("output", index) for the graph's outputs.
    `deferred`: the gradients left partial for the buckets (Lowering.partial_gradients)."""
    strategies, sizes = plan.node_strategies, plan.mesh.axis_sizes
    for node in cap.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        reader = node.name if node.op == "call_function" else "output"
        s = strategies.get(reader)
        if s is None:
            continue
        for i, a in enumerate(tensor_args(node)):
            own = strategies.get(a.name)
            src = tuple(own.output) if own is not None else (R,) * len(sizes)
            grads = a.name in grad_nodes
            gp = ()
            if grads and reader != "output":
                # an op whose gradient is left partial hands its inputs partial gradients on those axes
                gp = tuple(sorted(set(s.grad_partial(i)) | set(deferred.get(node.name, ()))))
            # a ZeRO weight's gradient stays unreduced on its axes, as does one the buckets reduce
            keep = (tuple(own.zero_axes) if own is not None and grads else ()) + deferred.get(a.name, ())
            yield (reader, i), a.name, src, tuple(s.inputs[i]), gp, keep


def layout_changes(cap: Captured, plan, uses: list, casts: dict) -> dict:
    """(producer, layout, gradient-partial axes) -> LayoutChange for each of `uses` (_uses) that changes its
    producer: another layout, another gradient reduction, or a weight cast for its use (`casts`: weight_casts)."""
    sizes = plan.mesh.axis_sizes
    out = {}
    for _, producer, src, dst, gp, keep in uses:
        key = (producer, dst, gp)
        if key in out or (src == dst and set(gp) == set(keep) and producer not in casts):
            continue
        try:
            steps = tuple(plan_steps(src, dst, gp, keep_partial=keep))
        except UnsupportedRedistribution as e:
            raise PlanError(f"plan asks for an unsupported layout change at {producer}: {e}") from e
        info = cap.info[producer]
        wholes = tuple(_step_whole(st, info.meta.hint, sizes) for st in steps) if info.kind == PARAM else None
        out[key] = LayoutChange(steps, wholes, gathers_again(steps, is_param=True),
                                gathers_again(steps, is_param=False))
    return out


def _step_whole(step, shape, axis_sizes) -> int | None:
    """The length of the dim `step` splits or gathers on its axis, whole along that axis."""
    for placements in (step.before, step.after):
        if is_shard(placements[step.axis]):
            return gathered_size(tuple(shape), placements, step.axis, axis_sizes)
    return None


def local_ops_of(cap: Captured, plan) -> dict:
    """call_function node -> its LocalOp (sharding/local_ops.local_op) where that is not a plain op's. Raises
    PlanError for an attention that would run as a ring and draws dropout, which a ring does not apply: the
    rules plan no ring for one, but another mode's graph of the model may have one (api._other_mode)."""
    names, sizes = plan.mesh.axis_names, plan.mesh.axis_sizes
    out = {}
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        op = local_op(cap, node, plan.node_strategies, sizes)
        if op.ring is not None and op.random is not None:
            raise PlanError(f"{node.name} runs as a ring attention over mesh axes {[names[op.ring.axis]]}, which "
                            f"applies no dropout, and it has dropout_p={op_arg(node, 4, 'dropout_p', 0.0)}")
        if op != PLAIN:
            out[node.name] = op
    return out


def _grouped_uses(cap: Captured, plan, uses: list, changes: dict, casts: dict) -> dict:
    """(reader, tensor input index) -> (gather axis, dtype, summed axes) for each use of a weight whose layout
    change (`changes`, of `uses`: layout_changes) is a groupable gather (cost/layer_groups.groupable): the rewriter
    serves it from the plan's layer group with that signature. None on a pipeline, whose stages hold only their
    own weights."""
    if plan.pipeline is not None:
        return {}
    names = plan.mesh.axis_names
    out = {}
    for use, producer, _, dst, gp, _ in uses:
        info = cap.info.get(producer)
        change = changes.get((producer, dst, gp))
        if info is None or info.kind != PARAM or change is None or not groupable(change.steps):
            continue
        steps = change.steps
        dtype = str(casts[producer][0] if producer in casts else info.meta.dtype)
        sums = tuple(names[x] for x in sorted(st.axis for st in steps[1:] if sums_gradient(st)))
        out[use] = (names[steps[0].axis], dtype, sums)
    return out


def recomputed_regions(cap: Captured, plan) -> tuple:
    """The blocks of the stacks `plan.checkpointed` ({path: kind}) names, each a Region, in that order then by
    block (cost/checkpointing.checkpointable_stacks on the plan's hardware)."""
    if not plan.checkpointed:
        return ()
    checkpointed = plan.checkpointed
    stacks = {st.key: st for st in checkpointable_stacks(cap, plan.hardware)}
    missing = [key for key in checkpointed.items() if key not in stacks]
    if missing:
        raise PlanError(f"the plan checkpoints {dict(missing)}, which this model's capture has no checkpointable "
                        "stack for: the plan was made for another model")
    out = []
    for path, kind in checkpointed.items():
        stack = stacks[path, kind]
        for i, block in enumerate(stack.blocks):
            out.append(Region(path, i, tuple(block), (stack.policies or (None,) * (i + 1))[i]))
    return tuple(out)


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
