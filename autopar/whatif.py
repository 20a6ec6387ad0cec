"""What-if queries: how large a batch fits, how large a batch hides communication, how many devices fit.

The first two read a plan's symbolic predictions; `min_axis_size` plans again
at candidate sizes of one mesh axis (a sharded size is no symbol: ceil(d / n)
per split dim, and the search may lay a weight out otherwise at another n).

A plan made with a dynamic batch (a `torch.export.Dim` on the inputs' dim 0 in
`dynamic_shapes`) carries its predictions as sympy expressions in that dim
(`plan.symbolic`). These functions read those expressions at other batch sizes,
so the answers follow the same cost model as the plan itself, without planning
again. The layout is fixed: a batch the plan was not made for may deserve
another plan, so treat an answer as "this plan, at that batch".

Other dynamic dims (a sequence length, say) are held at their example sizes
(`plan.symbols`). Every batch considered is a multiple of the number of batch
shards (the product of the sizes of `plan.batch_axes`), since the plan splits
the batch evenly over them.
"""
from __future__ import annotations

import math

import sympy
import torch

import cost_models as cm

from .capture.compute_dtype import at_compute_dtype
from .capture.export import AUTO, capture
from .capture.repeat import capture_repeated
from .cost.precision import precision_of
from .errors import AutoparError, InfeasiblePlanError
from .planning.result import Plan
from .planning.planner import plan_captured

# Doubling the batch more often than this means memory does not really grow with it
# (a term like 1e-30 * batch); a global batch of 2**64 samples is no batch anyone trains.
_MAX_DOUBLINGS = 64


def max_batch(plan: Plan, memory_limit, *, symbol: str | None = None) -> int:
    """The largest global batch whose predicted memory per device stays within `memory_limit`.

    `memory_limit` is bytes or a string like "80GiB". The batch is a multiple of
    the number of batch shards. `plan.symbolic.memory.total` never shrinks as
    the batch grows, so doubling then bisecting over integers finds its
    boundary exactly: at the returned batch the expression is within the
    limit, one more sample per shard is over it. `symbol` names the batch dim
    when the plan has several dynamic dims.

    The expression's transient term is the largest forward working set at
    every batch (a Max of the ops' working sets that can peak; see
    `predict.upper_envelope`): under FSDP a gathered weight adds a constant to
    its op's working set, so one op may peak at small batches and another at
    large ones. The answer is the cost model's own at every batch.
    """
    batch = _batch_symbol(plan, symbol, "max_batch")
    shards = _batch_shards(plan)
    try:
        limit = cm.parse_bytes(memory_limit)
    except cm.CostModelError as e:
        raise AutoparError(f"autopar.max_batch: memory_limit: {e}") from e
    memory = _at_example_sizes(plan.symbolic.memory.total, plan, batch)
    if batch not in memory.free_symbols:
        raise AutoparError(
            f"autopar.max_batch: the plan's predicted memory per device ({cm.format_bytes(float(memory))}) does not "
            f"depend on {batch} (neither what autograd keeps for backward nor any forward working set grows with "
            f"it), so memory_limit="
            f"{cm.format_bytes(limit)} is {'met' if memory <= limit else 'exceeded'} at every batch and sets no "
            "largest one; mark the batch dim of the inputs dynamic if another dim is, or pass symbol=")

    def fits(shards_each: int) -> bool:
        return bool(memory.xreplace({batch: sympy.Integer(shards * shards_each)}) <= limit)

    if not fits(1):
        smallest = memory.xreplace({batch: sympy.Integer(shards)})
        raise AutoparError(
            f"autopar.max_batch: even the smallest batch this plan takes, {shards} (one sample per batch shard over "
            f"{_axes_text(plan)}), needs {cm.format_bytes(float(smallest))} per device, over memory_limit="
            f"{cm.format_bytes(limit)}; raise the limit, or plan again with that limit (autopar.plan(..., "
            f"memory_limit=...)) so the search picks a layout that fits")
    most = _last_true(fits)
    if most is None:
        raise AutoparError(
            f"autopar.max_batch: the predicted memory per device grows so slowly with {batch} that no batch up to "
            f"{shards * 2**_MAX_DOUBLINGS} samples reaches memory_limit={cm.format_bytes(limit)}; the limit does "
            "not bound the batch")
    return shards * most


def min_compute_bound_batch(plan: Plan, *, symbol: str | None = None) -> int:
    """The smallest global batch from which compute time covers every mesh axis's communication time.

    At the returned batch B, and at every larger multiple of the batch shards,
    `plan.symbolic.compute_time >= plan.symbolic.comm_time[axis]` for every axis:
    each axis's collectives could hide behind the step's compute (whether they
    do is the plan's: `predicted.exposed_comm_time`, cost/overlap.py, says
    which part the step waits for). Axes with no
    communication are covered at any batch. The times are linear in the batch
    (every term is a tensor size or a per-collective latency); when an axis's
    communication grows at least as fast as compute and is not covered already,
    no batch covers it and this raises AutoparError naming the axis, rather
    than return a batch that stops being compute-bound as it grows.
    """
    batch = _batch_symbol(plan, symbol, "min_compute_bound_batch")
    shards = _batch_shards(plan)
    compute = _at_example_sizes(plan.symbolic.compute_time, plan, batch)
    smallest = 1  # in samples per batch shard
    for axis, comm in plan.symbolic.comm_time.items():
        comm = _at_example_sizes(comm, plan, batch)
        if comm.is_zero:  # no collective on this axis (0, or 0.0 after JSON)
            continue
        base, per_sample = _linear_terms(compute - comm, batch, axis)
        smallest = max(smallest, _first_covered(base, per_sample, shards, axis, compute, comm, batch))
    return shards * smallest


# the memory a model's size sets, whatever the batch: what "does it fit on N devices?" asks first
WEIGHT_PARTS = ("params", "master", "grads", "optimizer")


def min_axis_size(model, example_inputs, axis: str, memory_limit, *, mesh=None, parts=WEIGHT_PARTS,
                  strategy: str = "fsdp", max_size: int = 1 << 16, dynamic_shapes=AUTO,
                  trace_every_layer: bool = False, **plan_options) -> int:
    """The smallest size of mesh axis `axis` at which the plan's predicted memory per device, summed
    over `parts` of `plan.predicted.memory`, is within `memory_limit`.

    E.g. "the smallest FSDP degree at which weights, gradients and Adam state fit in 95 GB":
    `min_axis_size(model, (idx,), "dp", "95GB")`. `example_inputs` hold one device's batch along
    dim 0; at size n the plan is made for that times every axis's size. `mesh`: the other axes,
    {name: size}. The default parts are those the model's size sets (weights, master copy,
    gradients, optimizer state); add "activations" and "transient" for the whole step.
    `strategy` defaults to "fsdp", the one that splits the most of those parts over an axis; under
    "auto", which picks the fastest plan, each size is planned with `memory_limit` (so the answer
    is the smallest size with a plan whose whole step fits). `plan_options` (precision, optimizer,
    hardware, checkpointing, ...) go to autopar.plan, as `dynamic_shapes` and `trace_every_layer` do.

    No layout holds less than a 1/n share of what one device holds (padding only adds), so the
    sizes below whole / limit cannot fit: the scan starts there and plans at each size up from it
    until one fits, usually one or two plans. A strategy that splits none of `parts` over the axis
    (ddp, tp) shows at the first size tried past 1, and is said at once.
    """
    limit = _sizing_limit(memory_limit, axis, mesh, parts, plan_options)
    others = dict(mesh or {})
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    capture_fn = at_compute_dtype(capture if trace_every_layer else capture_repeated, model,
                                  precision_of(plan_options.get("precision")).compute)

    def needed(n: int) -> float:
        sizes = {**others, axis: n}
        batch = tuple(_repeat_batch(t, math.prod(sizes.values())) for t in inputs)
        cap = capture_fn(model, batch, dynamic_shapes)
        limited = {"memory_limit": limit} if strategy == "auto" and n > 1 else {}
        try:
            plan = plan_captured(cap, {axis: n, **others}, strategy=strategy, **limited, **plan_options)
        except InfeasiblePlanError:
            return math.inf
        return float(sum(getattr(plan.predicted.memory, p) for p in parts))

    whole = needed(1)
    n = max(2, math.ceil(whole / limit)) if whole > limit else 1
    while n <= max_size:
        at_n = needed(n)
        if at_n <= limit:
            return n
        if at_n >= whole and strategy != "auto":
            raise AutoparError(
                f"autopar.min_axis_size: strategy {strategy!r} does not split {'+'.join(parts)} over {axis!r} "
                f"({cm.format_bytes(at_n)} per device at size {n}, as on one device): ddp and tp keep weights or "
                "their state whole there; use 'fsdp', 'zero1' or 'zero2'")
        n += 1
    raise AutoparError(f"autopar.min_axis_size: no size of {axis!r} up to {max_size} brings {'+'.join(parts)} "
                       f"within {cm.format_bytes(limit)} per device under strategy {strategy!r}")


def _sizing_limit(memory_limit, axis: str, mesh, parts, plan_options: dict) -> float:
    """min_axis_size's request checked; the limit in bytes."""
    try:
        limit = cm.parse_bytes(memory_limit)
    except cm.CostModelError as e:
        raise AutoparError(f"autopar.min_axis_size: memory_limit: {e}") from e
    if axis in (mesh or {}):
        raise AutoparError(f"autopar.min_axis_size: axis {axis!r} is the one sized here; leave it out of mesh=")
    unknown = [p for p in parts if p not in ("params", "master", "grads", "optimizer", "activations", "transient")]
    if unknown:
        raise AutoparError(f"autopar.min_axis_size: parts {unknown} are not parts of plan.predicted.memory")
    if {"pipeline_axis", "microbatches", "schedule", "memory_limit"} & set(plan_options):
        raise AutoparError("autopar.min_axis_size sizes a flat plan under its own memory_limit: leave out "
                           "pipeline_axis, microbatches, schedule and memory_limit")
    return limit


def _repeat_batch(t, times: int):
    """`t` with its dim 0 `times` as long (meta tensors stay on meta: nothing is allocated)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if t.is_meta:
        return torch.empty((t.shape[0] * times,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta")
    return t.repeat((times,) + (1,) * (t.dim() - 1))


# ----------------------------------------------------------------------------- the batch dim

def _batch_symbol(plan: Plan, name: str | None, query: str) -> sympy.Symbol:
    """The symbol of the batch dim: `name`, or else the plan's only dynamic dim.

    A plan does not record which input dim each symbol came from, so a plan
    whose only dynamic dim is, say, the sequence cannot be told apart here: the
    public docstrings say that the batch is the dim to mark dynamic.
    """
    if not plan.symbols:
        raise AutoparError(
            f"autopar.{query}: this plan has no dynamic dims, so its predictions are numbers for the example batch only; plan again "
            "with the batch marked dynamic, e.g. autopar.plan(model, (x,), mesh, "
            "dynamic_shapes={'x': {0: torch.export.Dim('batch')}}) (the key is forward's argument name)")
    if name is None:
        if len(plan.symbols) > 1:
            raise AutoparError(
                f"autopar.{query}: this plan has several dynamic dims ({', '.join(sorted(plan.symbols))}); say which is the batch "
                f"(the inputs' dim 0) with symbol=, e.g. symbol={min(plan.symbols)!r}")
        name = next(iter(plan.symbols))
    name = str(name)
    if name not in plan.symbols:
        raise AutoparError(f"autopar.{query}: symbol={name!r} is not a dynamic dim of this plan; its dynamic dims are "
                           f"{', '.join(sorted(plan.symbols))}")
    # the expressions' own symbol (its assumptions included), so substitution finds it
    for sym in _free_symbols(plan):
        if sym.name == name:
            return sym
    return sympy.Symbol(name, integer=True, positive=True)  # as capture makes them; in no expression


def _batch_shards(plan: Plan) -> int:
    """How many shards the plan splits the batch into: the product of its batch axes' sizes."""
    return math.prod(plan.mesh.axis_sizes[plan.mesh.axis_index(a)] for a in plan.batch_axes)


def _free_symbols(plan: Plan) -> set:
    s = plan.symbolic
    exprs = [s.memory.total, s.compute_time, *s.comm_time.values()]
    return set().union(*(sympy.sympify(e).free_symbols for e in exprs))


def _at_example_sizes(expr, plan: Plan, batch: sympy.Symbol) -> sympy.Expr:
    """`expr` with every dynamic dim but the batch at its example size."""
    expr = sympy.sympify(expr)
    others = {s: plan.symbols[s.name] for s in expr.free_symbols if s != batch and s.name in plan.symbols}
    expr = expr.xreplace(others)
    unknown = expr.free_symbols - {batch}
    if unknown:  # only a hand-edited plan gets here: every symbol comes from the capture
        raise AutoparError(f"the plan's predictions use symbols {sorted(map(str, unknown))} that plan.symbols does "
                           "not list; make the plan again with autopar.plan")
    return expr


def _axes_text(plan: Plan) -> str:
    return " x ".join(f"{a}={plan.mesh.axis_sizes[plan.mesh.axis_index(a)]}" for a in plan.batch_axes) or "no axis"


# ----------------------------------------------------------------------------- searches

def _last_true(holds) -> int | None:
    """The largest k >= 1 with holds(k), given holds(1) and that holds stays false once false.

    Doubling finds a k where it fails, bisection the boundary: exact, since
    holds is evaluated at integers. None when it holds up to 2**_MAX_DOUBLINGS.
    """
    low, high = 1, 2
    for _ in range(_MAX_DOUBLINGS):
        if not holds(high):
            break
        low, high = high, 2 * high
    else:
        return None
    while high - low > 1:  # holds(low) and not holds(high)
        mid = (low + high) // 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low


def _linear_terms(expr, batch, axis: str) -> tuple:
    """(a, b) with expr == a + b * batch; AutoparError if expr is not linear in the batch."""
    expr = sympy.expand(expr)
    per_sample, base = expr.coeff(batch, 1), expr.coeff(batch, 0)
    rest = sympy.expand(expr - base - per_sample * batch)
    if not rest.is_zero or batch in base.free_symbols or batch in per_sample.free_symbols:
        raise AutoparError(
            f"autopar.min_compute_bound_batch: compute minus communication on mesh axis {axis!r} is not linear in "
            f"{batch} ({expr}); the cost model's times are sums of sizes and latencies, so this plan was not made "
            "by it (a hand-edited or foreign plan?)")
    return base, per_sample


def _first_covered(base, per_sample, shards: int, axis: str, compute, comm, batch) -> int:
    """Smallest k >= 1 with base + per_sample * shards * j >= 0 for every j >= k."""
    def covered(k: int) -> bool:
        return bool(base + per_sample * shards * k >= 0)

    if per_sample.is_positive:
        k = max(1, int(sympy.ceiling(-base / (per_sample * shards))))
        # the ceiling of a float quotient may be one off; settle it on the expression itself
        while k > 1 and covered(k - 1):
            k -= 1
        while not covered(k):
            k += 1
        return k
    if per_sample.is_zero and covered(1):
        return 1  # compute and communication grow alike and compute is ahead already
    grow_compute, grow_comm = sympy.expand(compute).coeff(batch, 1), sympy.expand(comm).coeff(batch, 1)
    raise AutoparError(
        f"autopar.min_compute_bound_batch: on mesh axis {axis!r} communication ({_seconds(comm, batch)}) grows at "
        f"least as fast as compute ({_seconds(compute, batch)}) with {batch} ({float(grow_comm):.3g} vs "
        f"{float(grow_compute):.3g} s per sample), so no batch makes compute cover it; communicate less on {axis!r} "
        f"(a smaller axis, another strategy) or give it a faster link (autopar.plan(..., links={{{axis!r}: "
        f"cost_models.Link(...)}}))")


def _seconds(expr, batch) -> str:
    expr = sympy.expand(expr)
    return f"{float(expr.coeff(batch, 0)):.3g} s + {float(expr.coeff(batch, 1)):.3g} s * {batch}"
