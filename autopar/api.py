"""The public entry points: autopar.plan (offline) and autopar.parallelize (on every rank)."""
from __future__ import annotations

import sys
import time

import torch

import cost_models as cm

from .blocks import find_blocks
from .checkpointing import check_mode, checkpointable_stacks
from .capture import PARAM, Captured, capture
from .classics import axis_roles, check_tensor_parallel_divisibility, role_assignments
from .collectives import AxisGroup, Comm
from .cost import first_meta, needs_grad, saved_outputs
from .errors import AutoparError, InfeasiblePlanError, MeshError, PlanError, ShardingError
from .liveness import live_sets
from .mesh import MeshSpec, mesh_spec
from .plan_result import CollectiveRecord, Plan
from .precision import as_computed, optimizer_spec, param_bytes as param_bytes_of, precision_of
from .predict import predict
from .repeat import capture_repeated
from .rewrite import rewrite
from .runtime import ParallelModule
from .search import Problem, Solution, build_edges, solve
from .strategies import all_strategies


def _hardware(hardware, mesh):
    default = "h100"
    if hasattr(mesh, "device_type") and mesh.device_type == "cpu":
        default = "cpu"
    try:
        return cm.get_hardware(hardware, default=default)
    except cm.CostModelError as e:
        raise AutoparError(str(e)) from e


def _memory_limit(value):
    if value is None:
        return None
    try:
        return cm.parse_bytes(value)
    except cm.CostModelError as e:
        raise AutoparError(f"memory_limit: {e}") from e


def _check_batch_divisible(cap: Captured, spec: MeshSpec, roles) -> None:
    """A named classic that splits the batch needs every input's batch dim to divide."""
    pinned = [a for a, split in roles.batch_axes().items() if split]
    if not pinned:
        return
    n = 1
    for a in pinned:
        n *= spec.axis_sizes[a]
    for name in cap.input_names:
        meta = first_meta(cap.info[name].meta)
        if meta is not None and meta.ndim > 0 and meta.hint[0] % n:
            axes = ", ".join(f"{spec.axis_names[a]}={spec.axis_sizes[a]}" for a in pinned)
            raise ShardingError(
                f"input {name!r} has batch size {meta.hint[0]} (dim 0), which the batch-splitting mesh axes "
                f"({axes}) cannot divide into {n} equal shards; use a global batch that is a multiple of {n}")


def plan(model: torch.nn.Module, example_inputs, mesh, *, hardware=None, memory_limit=None,
         strategy: str = "auto", precision=None, optimizer="adamw", checkpointing: str = "auto",
         dynamic_shapes=None, links=None, time_limit: float = 60.0, trace_every_layer: bool = False,
         **options) -> Plan:
    """Plan how to split `model` over `mesh`, without running it or touching a process group.

    `mesh` is a DeviceMesh with named axes or a mapping {axis_name: size}; the
    model may live on the meta device. `precision` (an autopar.Precision, or
    None for the model's own dtype) and `optimizer` ("adamw", "adam", "sgd",
    "sgd-momentum" or a torch optimizer) set the bytes each parameter costs;
    AdamW is the default because it is what large models train with.
    `checkpointing`: "auto" lets the search recompute stacks of repeated
    blocks when that is what fits memory_limit (it only costs time, so never
    without a limit); "full" recomputes every such stack; "none" never.
    The model is traced with each stack of alike layers (an nn.ModuleList of
    one class, same parameter shapes) cut to three, the rest copied from the
    last (autopar.repeat), so depth adds little time. `trace_every_layer=True`
    traces every layer, for a model whose alike layers run different code
    (e.g. a per-layer attention type in its config).
    See docs/ARCHITECTURE.md.
    """
    if options:
        raise AutoparError(f"unknown option(s) {sorted(options)} for autopar.plan")
    # bad values fail before the capture, which takes seconds
    precision_of(precision)
    optimizer_spec(optimizer)
    check_mode(checkpointing)
    t0 = time.perf_counter()
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    cap = (capture if trace_every_layer else capture_repeated)(model, example_inputs, dynamic_shapes)
    t_capture = time.perf_counter() - t0
    return _plan_captured(cap, mesh, hardware=hardware, memory_limit=memory_limit, strategy=strategy,
                          precision=precision, optimizer=optimizer, checkpointing=checkpointing, links=links,
                          time_limit=time_limit, t_capture=t_capture)


def _plan_captured(cap: Captured, mesh, *, hardware=None, memory_limit=None, strategy="auto", precision=None,
                   optimizer="adamw", checkpointing="auto", links=None, time_limit=60.0, t_capture=0.0,
                   tie_blocks=True) -> Plan:
    spec = mesh_spec(mesh)
    check_mode(checkpointing)
    policy, opt = precision_of(precision), optimizer_spec(optimizer)
    param_bytes = {n: param_bytes_of(policy, opt, first_meta(i.meta).dtype) for n, i in cap.info.items()
                   if i.kind == PARAM}
    cap = as_computed(cap, policy)  # the graph as it runs: floating tensors in the compute dtype
    hw = _hardware(hardware, mesh)
    try:
        axis_links = cm.axis_links(list(zip(spec.axis_names, spec.axis_sizes)), hw, links)
    except cm.CostModelError as e:
        raise MeshError(str(e)) from e
    limit = _memory_limit(memory_limit)
    roles = axis_roles(strategy, spec)
    _check_batch_divisible(cap, spec, roles)
    check_tensor_parallel_divisibility(cap, roles)
    t0 = time.perf_counter()
    canonical = find_blocks(cap).canonical if tie_blocks else {}
    strategies = all_strategies(cap, spec, same_as=canonical)
    prob = Problem(cap, spec, axis_links, hw, strategies, build_edges(cap, strategies),
                   needs_grad(cap), saved_outputs(cap, hw), param_bytes, canonical, live_sets(cap),
                   stacks=checkpointable_stacks(cap) if checkpointing != "none" else ())
    if checkpointing == "full" and not prob.stacks:
        raise PlanError("checkpointing='full' found no stack of repeated blocks to checkpoint (an nn.ModuleList "
                        "of 2+ layers whose ops run one layer after another); use checkpointing='auto' or 'none'")
    t_rules = time.perf_counter() - t0
    tiers = [[roles]]
    if strategy == "auto" and spec.num_axes >= AUTO_BY_ROLE_AXES:
        intra = [axis_links[a] == hw.intra_node_link for a in spec.axis_names]
        # if no assignment fits (e.g. a batch too small to split over every data axis),
        # the ones that leave one axis to the search
        tiers = [role_assignments(spec, intra), role_assignments(spec, intra, num_free=1)]
    for candidates in tiers:
        sol, roles = _best(prob, candidates, limit, time_limit, checkpointing=checkpointing)
        if sol.choice:
            break
    if not sol.choice:
        free, _ = _best(prob, candidates, None, time_limit) if limit is not None else (sol, roles)
        if not free.choice:
            raise ShardingError(
                f"strategy {strategy!r} cannot be laid out on mesh {spec}: some tensor dim does not divide by "
                "the axis sizes it must be split over (e.g. heads or hidden size vs the tensor-parallel degree); "
                "use strategy='auto', another mesh, or sizes divisible by the axis sizes")
        least, _ = _best(prob, candidates, None, time_limit, minimize_memory=True, checkpointing=checkpointing)
        raise InfeasiblePlanError(
            f"no {strategy!r} plan on mesh {spec} fits memory_limit={cm.format_bytes(limit)} per device: "
            f"the smallest any such plan needs is {cm.format_bytes(least.objective)} "
            f"({least.objective:.0f} bytes). Raise the limit, add devices, or try another strategy.",
            min_memory_bytes=least.objective)
    t0 = time.perf_counter()
    pred, colls = predict(prob, sol.choice, symbolic=False, checkpointed=sol.checkpointed)
    sym, _ = predict(prob, sol.choice, symbolic=True, checkpointed=sol.checkpointed)
    t_predict = time.perf_counter() - t0
    node_strategies = {n: ns.strategies[sol.choice[n]] for n, ns in strategies.items()}
    param_placements = {cap.info[n].target_name: s.output for n, s in node_strategies.items()
                        if cap.info[n].kind == PARAM}
    param_zero = {cap.info[n].target_name: (s.zero, tuple(spec.axis_names[a] for a in s.zero_axes))
                  for n, s in node_strategies.items() if cap.info[n].kind == PARAM and s.zero}
    input_placements = tuple(node_strategies[n].output if n in node_strategies else (("R",) * spec.num_axes)
                             for n in cap.input_names)
    output_placements = tuple(node_strategies["output"].inputs)
    records = tuple(CollectiveRecord(c.kind, spec.axis_names[c.axis], c.phase, float(c.full_bytes), c.where,
                                     cap.info[c.where].module_path if c.where in cap.info else "", c.tensor)
                    for c in colls)
    stats = {"capture_seconds": t_capture, "rules_seconds": t_rules, "build_seconds": sol.build_seconds,
             "solve_seconds": sol.solve_seconds, "predict_seconds": t_predict,
             "axis_roles": ",".join(f"{a}={r or 'any'}" for a, r in zip(spec.axis_names, roles.roles)),
             "searches": len(candidates),
             "status": sol.status, "objective_seconds": sol.objective,
             "num_nodes": len(strategies), "num_edges": len(prob.edges),
             "num_variables": sol.num_variables, "num_constraints": sol.num_constraints,
             "mip_gap": sol.mip_gap}
    return Plan(mesh=spec, strategy=strategy, hardware=hw.name,
                batch_axes=tuple(spec.axis_names[a] for a in sol.batch_axes),
                node_strategies=node_strategies, param_placements=param_placements,
                input_placements=input_placements, output_placements=output_placements,
                module_paths={n: cap.info[n].module_path for n in strategies},
                collectives=records, predicted=pred, symbolic=sym,
                symbols={str(s): v for s, v in cap.hints.items()}, stats=stats, param_zero=param_zero,
                precision=policy.to_dict(), optimizer={"name": opt.name, "states_per_param": opt.states_per_param},
                checkpointed=sol.checkpointed)


# from this many mesh axes on, `auto` fixes each axis's role first (classics.role_assignments):
# one search over every layout on 3+ axes grows too large to solve in seconds
AUTO_BY_ROLE_AXES = 3


def _best(prob: Problem, candidates: list, limit, time_limit, minimize_memory=False, checkpointing="none"):
    """The best solution over several role assignments (the first assignment's if none solves)."""
    best = None
    total_seconds = build_seconds = 0.0
    for i, roles in enumerate(candidates):
        if len(candidates) > 1:
            _progress(f"search {i + 1}/{len(candidates)}: " + ",".join(
                f"{a}={r or 'any'}" for a, r in zip(roles.axis_names, roles.roles)))
        try:
            sol = solve(prob, roles, limit, time_limit, minimize_memory=minimize_memory,
                        gap=1e-6 if minimize_memory else 1e-3, checkpointing=checkpointing)
        except (ShardingError, InfeasiblePlanError):   # these roles cannot lay out some node
            if len(candidates) == 1:
                raise
            continue
        total_seconds += sol.solve_seconds
        build_seconds += sol.build_seconds
        if sol.choice and (best is None or sol.objective < best[0].objective):
            best = (sol, roles)
    if len(candidates) > 1:
        _progress("")
    if best is None:
        return Solution({}, (), float("inf"), total_seconds, "infeasible", build_seconds=build_seconds), candidates[0]
    sol, roles = best
    sol.solve_seconds, sol.build_seconds = total_seconds, build_seconds
    return sol, roles


def _progress(text: str) -> None:
    """One status line on a terminal (rewritten in place); nothing when stderr is a file or pipe."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[Kautopar: {text}" if text else "\r\033[K")
        sys.stderr.flush()


def parallelize(model: torch.nn.Module, mesh, example_inputs, *, plan: Plan | None = None,
                dynamic_shapes=None, record_comm: bool = False, **plan_kwargs) -> ParallelModule:
    """Run on every rank: returns this rank's module, holding only its shards.

    `example_inputs` are global (whole-batch) example inputs; the returned
    module takes this rank's shard of the inputs (`model.plan.local_inputs`).
    `record_comm=True` logs every collective (model.comm.log) for audits.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise MeshError("parallelize needs a torch DeviceMesh (e.g. init_device_mesh('cpu', (2, 2), "
                        "mesh_dim_names=('dp', 'tp'))); for planning without devices use autopar.plan")
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialized; run under torchrun and call "
                        "init_device_mesh first")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    spec = mesh_spec(mesh)
    cap = capture(model, example_inputs, dynamic_shapes)
    if plan is None:
        plan = _plan_on_rank0(cap, mesh, plan_kwargs)
    _check_plan_matches(plan, cap, spec)
    _check_runtime_precision(plan, cap)
    coords = mesh.get_coordinate()
    axes = [AxisGroup(mesh.get_group(name), size, coords[i])
            for i, (name, size) in enumerate(zip(spec.axis_names, spec.axis_sizes))]
    from .collectives import CommLog
    comm = Comm(axes, CommLog() if record_comm else None)
    gm, gathered = rewrite(cap, plan, comm, needs_grad(cap))
    return ParallelModule(gm, gathered, cap, plan, comm, model, device_mesh=mesh)


def _plan_on_rank0(cap: Captured, mesh, plan_kwargs: dict) -> Plan:
    """Rank 0 plans and broadcasts the plan, so ranks cannot disagree (and plan once, not N times).

    An error on rank 0 is broadcast too and raised on every rank, so no rank
    waits forever for a plan that will not come.
    """
    import torch.distributed as dist
    known = {"hardware", "memory_limit", "strategy", "links", "time_limit", "precision", "optimizer",
             "checkpointing"}
    unknown = sorted(set(plan_kwargs) - known)
    if unknown:
        raise AutoparError(f"unknown option(s) {unknown} for autopar.parallelize; it takes plan=, "
                           f"dynamic_shapes=, record_comm= and the planning options {sorted(known)}")
    message = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", _plan_captured(cap, mesh, **plan_kwargs).to_json())
        except AutoparError as e:
            message[0] = ("error", e)
    dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        raise payload
    return Plan.from_json(payload)


def _check_plan_matches(plan: Plan, cap: Captured, spec: MeshSpec) -> None:
    if plan.mesh != spec:
        raise PlanError(f"the plan was made for mesh {plan.mesh}, not {spec}")
    missing = [n for n in plan.node_strategies if n not in cap.info]
    if missing:
        raise PlanError(f"the plan names graph nodes this model does not have ({missing[:5]}...): "
                        "it was made for another model or other example inputs")


def _check_runtime_precision(plan: Plan, cap: Captured) -> None:
    """The runtime trains in the model's own dtype; a plan for another policy cannot run as planned."""
    dtypes = {str(first_meta(i.meta).dtype).removeprefix("torch.") for i in cap.info.values()
              if i.kind == PARAM and first_meta(i.meta).dtype.is_floating_point}
    asked = {f: d for f, d in plan.precision.items() if d is not None and {d} != dtypes}
    if asked:
        raise PlanError(
            f"the plan's precision policy {asked} differs from the model's parameter dtype(s) {sorted(dtypes)}; "
            "autopar plans mixed precision (autopar.plan) but its runtime trains in the model's own dtype. "
            "Convert the model (model.to(dtype)) and plan with precision=None to run it")
