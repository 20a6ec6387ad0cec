"""Lowering: what the rewriter does to one captured graph beyond the per-node layouts, decided with the plan.

Which gradients stay partial for the buckets and the gradient scales, the weights cast for mixed precision,
which weight uses join an FSDP layer group, the recomputed blocks, how each op runs on a rank's shards
(sharding/local_ops.LocalOp), the steps of each layout change, and the linears that run in float8: made by
`lowering_of` from the plan's layouts, so the runtime reads it (runtime/lowering/rewrite.py) and imports
nothing of cost/ or search/ (tests/test_layering.py), nor asks sharding/ again what the plan implies. A plan's
Schedule (schedule.py) carries it, and plan JSON with it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

from ..capture.export import PARAM, Captured
from ..cost.buckets import bucket_grad_scale, output_grad_scale, partial_gradients
from ..cost.checkpointing import SavePolicy, checkpointable_stacks
from ..cost.float8 import float8_gathered_params, gathers_in_float8, shared_input_scales
from ..cost.layer_groups import groupable, sums_gradient
from ..cost.precision import precision_of
from ..cost.terms import first_meta
from ..errors import PlanError
from ..sharding.local_ops import PLAIN, LocalOp, Ring, VocabLookup, VocabLoss, local_op
from ..sharding.op_spec import op_arg, tensor_args
from ..sharding.placement import R, gathered_size, is_shard, shard_dim
from ..sharding.redistribute import Step, UnsupportedRedistribution, gathers_again, plan_steps


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
    # the float8 linears whose weight its FSDP layer group casts and gathers in float8 (cost/float8.py:
    # enable_fsdp_float8_all_gather), in graph order
    float8_gathers: tuple = ()
    # float8 linear -> the earlier float8 linear whose forward activation scale it reuses: both read the same
    # tensor in the same layout by the same recipe (the query, key and value projections; gate and up), so one
    # amax and its all-reduce serve both (cost/float8.shared_input_scales)
    float8_shared_scales: dict = field(default_factory=dict)

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
                                for n, (recipe, splits) in self.float8.items()]} if self.float8 else {}),
                **({"float8_gathers": list(self.float8_gathers)} if self.float8_gathers else {}),
                **({"float8_shared_scales": dict(self.float8_shared_scales)} if self.float8_shared_scales else {})}

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
                                for n, recipe, splits in d.get("float8", ())},
                        float8_gathers=tuple(d.get("float8_gathers", ())),
                        float8_shared_scales=dict(d.get("float8_shared_scales", {})))


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
    grouped = _grouped_uses(cap, plan, uses, changes, casts)
    return Lowering(deferred, bucket_grad_scale(cap, plan, grad_nodes, deferred), scales,
                    {n: (str(c), str(r)) for n, (c, r) in casts.items()},
                    grouped, recomputed_regions(cap, plan),
                    lowering_key(cap, plan), ops=local_ops_of(cap, plan), layout_changes=changes,
                    float8=float8_uses(cap, plan), float8_gathers=float8_gathers(cap, plan, uses, changes, grouped),
                    float8_shared_scales=shared_input_scales(cap, plan.float8_linears, plan.node_strategies))


def float8_gathers(cap: Captured, plan, uses: list, changes: dict, grouped: dict) -> tuple:
    """The float8 linears (plan.float8_linears) whose weight's FSDP layer group gathers it in float8: the
    weights cost/float8.float8_gathered_params names, where their layout change joins the group as is
    (cost/float8.gathers_in_float8, the rule the cost model priced the gather by)."""
    if not plan.float8_linears:
        return ()
    gathered = float8_gathered_params(cap, plan.float8_linears, precision_of(plan.precision).float8)
    out = []
    for use, producer, _, dst, gp, _ in uses:
        if producer in gathered and use[1] == 1 and use[0] in plan.float8_linears and use in grouped and \
                gathers_in_float8(changes[(producer, dst, gp)].steps, first_meta(cap.info[producer].meta).hint,
                                  dst, plan.mesh.axis_sizes):
            out.append(use[0])
    order = {n: k for k, n in enumerate(plan.float8_linears)}
    return tuple(sorted(set(out), key=order.get))


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
