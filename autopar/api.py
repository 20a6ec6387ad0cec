"""The public entry points: autopar.plan (offline) and autopar.parallelize (on every rank)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

import cost_models as cm

from .capture.blocks import find_blocks
from .cost.checkpointing import check_mode, checkpointable_stacks
from .capture.export import AUTO, PARAM, Captured, capture, mode_dependent_ops, same_structure
from .search.classics import (PIPE, Roles, axis_roles, check_tensor_parallel_divisibility, role_assignments,
                              with_pipeline)
from .runtime.collectives import AxisGroup, Comm
from .cost.terms import first_meta, needs_grad, saved_outputs
from .errors import AutoparError, CaptureError, InfeasiblePlanError, MeshError, PipelineError, PlanError, ShardingError
from .cost.liveness import live_sets
from .mesh import MeshSpec, mesh_spec
from .plan_result import CollectiveRecord, Plan
from .cost.precision import as_computed, optimizer_spec, param_bytes as param_bytes_of, precision_of
from .search.pipeline import (GPIPE, ONE_F_ONE_B, STAGES_PER_DEVICE, check_depth, check_request,
                              device_prediction, microbatch_candidates, num_layers, op_costs, partition)
from .cost.predict import group_redistributions, peak_working_set, predict
from .capture.repeat import capture_repeated
from .runtime.rewrite import rewrite
from .runtime.module import ParallelModule
from .search.ilp import Problem, Solution, build_edges, solve
from .sharding.strategies import all_strategies


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
         dynamic_shapes=AUTO, links=None, time_limit: float = 60.0, trace_every_layer: bool = False,
         pipeline_axis: str | None = None, microbatches: int | None = None, schedule: str | None = None,
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
    `pipeline_axis`: None (the default) never pipelines; "auto" lets the
    search pipeline over an axis when that is faster or is what fits; a name
    pins the axis. A pipelined module trains through
    ParallelModule.train_step, not forward + backward, which is why the
    search does not pick one unasked: a loop written for forward would break.
    `microbatches` (default: the search tries p, 2p and 4p) and `schedule`
    ("1f1b" by default: it holds fewer activations than "gpipe" for the same
    bubble; or "interleaved-1f1b") pin those choices. See docs/ARCHITECTURE.md.
    """
    if options:
        raise AutoparError(f"unknown option(s) {sorted(options)} for autopar.plan")
    # bad values fail before the capture, which takes seconds
    precision_of(precision)
    optimizer_spec(optimizer)
    check_mode(checkpointing)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    check_request(mesh_spec(mesh), pipeline_axis, microbatches, schedule, _first_batch(example_inputs))
    t0 = time.perf_counter()
    capture_fn = capture if trace_every_layer else capture_repeated
    cap = capture_fn(model, example_inputs, dynamic_shapes)
    t_capture = time.perf_counter() - t0
    return _plan_captured(cap, mesh, hardware=hardware, memory_limit=memory_limit, strategy=strategy,
                          precision=precision, optimizer=optimizer, checkpointing=checkpointing, links=links,
                          time_limit=time_limit, t_capture=t_capture, pipeline_axis=pipeline_axis,
                          microbatches=microbatches, schedule=schedule,
                          recapture=_recapture(capture_fn, model, example_inputs, dynamic_shapes))


def _first_batch(example_inputs: tuple):
    t = example_inputs[0] if example_inputs else None
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else None


def microbatch_inputs(example_inputs: tuple, m: int) -> tuple:
    """The first 1/m of the batch (dim 0) of every tensor input: one microbatch, as a pipeline stage runs."""
    return tuple(t[: t.shape[0] // m] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in example_inputs)


def _recapture(capture_fn, model, example_inputs: tuple, dynamic_shapes):
    """capture at 1/m of the batch, once per m: a pipelined plan is made for the graph of one microbatch."""
    done: dict = {}

    def at(m: int) -> Captured:
        if m not in done:
            done[m] = capture_fn(model, microbatch_inputs(example_inputs, m), dynamic_shapes)
        return done[m]
    return at


def _plan_captured(cap: Captured, mesh, *, hardware=None, memory_limit=None, strategy="auto", precision=None,
                   optimizer="adamw", checkpointing="auto", links=None, time_limit=60.0, t_capture=0.0,
                   tie_blocks=True, pipeline_axis=None, microbatches=None, schedule=None,
                   recapture=None) -> Plan:
    """The plan for a captured model. `recapture(m)` captures it again with batches of 1/m the size,
    which a pipelined plan is made for (its graph runs one microbatch at a time); without it the
    search does not pipeline."""
    spec = mesh_spec(mesh)
    check_mode(checkpointing)
    check_request(spec, pipeline_axis, microbatches, schedule, _batch_size(cap))
    env = _Setting(cap, spec, mesh, hardware, memory_limit, strategy, precision, optimizer, checkpointing, links,
                   time_limit, t_capture, tie_blocks)
    axes = _pipeline_axes(cap, spec, strategy, pipeline_axis, schedule) if recapture is not None else []
    if pipeline_axis not in (None, "auto") and recapture is None:
        raise PipelineError("a pipelined plan needs the model to capture it again per microbatch; "
                            "plan it with autopar.plan or autopar.parallelize")
    best, failure = None, None
    if pipeline_axis in (None, "auto"):
        try:
            best = _flat_plan(cap, env)
        except InfeasiblePlanError as e:
            if not axes:
                raise
            failure = e
    bound = _serial_time(best, spec) if best is not None and pipeline_axis == "auto" else None
    for axis in axes:
        p = spec.axis_sizes[spec.axis_index(axis)]
        for m in microbatch_candidates(p, _batch_size(cap) or 1, microbatches):
            # a pipeline idles (p-1)/m of the step at least: no faster than the serial compute spread
            # over every device, stretched by that
            if bound is not None and best.predicted.step_time <= bound * (1 + (p - 1) / m):
                continue
            if (schedule or ONE_F_ONE_B) != GPIPE and m < p:
                # torch's 1F1B schedules refuse it at the first step: every stage needs a microbatch in flight
                if microbatches is not None:
                    raise PipelineError(f"microbatches={m} is fewer than the {p} stages on axis {axis!r}; "
                                        f"schedule {schedule or ONE_F_ONE_B!r} needs at least {p} (or use "
                                        "schedule='gpipe')")
                continue
            try:
                found = _pipelined_plan(recapture(m), env, axis, m, schedule or ONE_F_ONE_B)
            except (PipelineError, InfeasiblePlanError, ShardingError) as e:
                if pipeline_axis not in (None, "auto") and microbatches is not None:
                    raise
                failure = failure or e
                continue
            if best is None or found.predicted.step_time < best.predicted.step_time:
                best = found
    if best is None:
        if failure is not None:
            raise failure
        raise PipelineError(f"no pipelined plan over {pipeline_axis!r} could be made (see the microbatch counts "
                            "tried); pin microbatches= to see why")
    return best


@dataclass
class _Setting:
    """What every search of one planning request shares."""
    cap: Captured
    spec: MeshSpec
    mesh: object          # as given: a DeviceMesh's device type picks the default hardware
    hardware: object
    memory_limit: object
    strategy: str
    precision: object
    optimizer: object
    checkpointing: str
    links: object
    time_limit: float
    t_capture: float
    tie_blocks: bool


def _batch_size(cap: Captured):
    meta = first_meta(cap.info[cap.input_names[0]].meta) if cap.input_names else None
    return meta.hint[0] if meta is not None and meta.ndim > 0 else None


def _pipeline_axes(cap: Captured, spec: MeshSpec, strategy: str, pipeline_axis, schedule) -> list:
    """Axes to try pipelining over: the one named, or under "auto" every axis the model has the layers for."""
    if pipeline_axis is None:
        return []
    if pipeline_axis != "auto":
        check_depth(cap, spec.axis_sizes[spec.axis_index(pipeline_axis)]
                    * STAGES_PER_DEVICE[schedule or ONE_F_ONE_B], pipeline_axis)
        return [pipeline_axis]
    if strategy != "auto":
        return []
    layers = max(num_layers(cap).values(), default=1)
    per_device = STAGES_PER_DEVICE[schedule or ONE_F_ONE_B]
    return [name for name, size in zip(spec.axis_names, spec.axis_sizes) if 1 < size and size * per_device <= layers]


def _serial_time(plan: Plan, spec: MeshSpec) -> float:
    """A floor on any plan's step: the plan's compute as if every device did an equal share, no comm.
    (The plan's compute is per device; the devices that split the batch share the work.)"""
    shards = 1
    for a in plan.batch_axes:
        shards *= spec.axis_sizes[spec.axis_index(a)]
    return plan.predicted.compute_time * shards / spec.num_devices


def _problem(cap: Captured, env: _Setting, checkpointing: str):
    spec = env.spec
    policy, opt = precision_of(env.precision), optimizer_spec(env.optimizer)
    param_bytes = {n: param_bytes_of(policy, opt, first_meta(i.meta).dtype) for n, i in cap.info.items()
                   if i.kind == PARAM}
    cap = as_computed(cap, policy)  # the graph as it runs: floating tensors in the compute dtype
    hw = _hardware(env.hardware, env.mesh)
    try:
        axis_links = cm.axis_links(list(zip(spec.axis_names, spec.axis_sizes)), hw, env.links)
    except cm.CostModelError as e:
        raise MeshError(str(e)) from e
    canonical = find_blocks(cap).canonical if env.tie_blocks else {}
    strategies = all_strategies(cap, spec, same_as=canonical)
    prob = Problem(cap, spec, axis_links, hw, strategies, build_edges(cap, strategies),
                   needs_grad(cap), saved_outputs(cap, hw), param_bytes, canonical, live_sets(cap),
                   stacks=checkpointable_stacks(cap) if checkpointing != "none" else ())
    return prob, policy, opt, hw


def _flat_plan(cap: Captured, env: _Setting) -> Plan:
    spec, strategy, checkpointing, time_limit = env.spec, env.strategy, env.checkpointing, env.time_limit
    limit = _memory_limit(env.memory_limit)
    roles = axis_roles(strategy, spec)
    _check_batch_divisible(cap, spec, roles)
    check_tensor_parallel_divisibility(cap, roles)
    t0 = time.perf_counter()
    prob, policy, opt, hw = _problem(cap, env, checkpointing)
    if checkpointing == "full" and not prob.stacks:
        raise PlanError("checkpointing='full' found no stack of repeated blocks to checkpoint (an nn.ModuleList "
                        "of 2+ layers whose ops run one layer after another); use checkpointing='auto' or 'none'")
    t_rules = time.perf_counter() - t0
    tiers = [[roles]]
    if strategy == "auto" and spec.num_axes >= AUTO_BY_ROLE_AXES:
        tiers = _role_tiers(spec, prob.links, hw)
    for candidates in tiers:
        sol, roles = _best(prob, candidates, limit, time_limit, checkpointing=checkpointing)
        if sol.choice:
            break
    if not sol.choice:
        _explain_no_plan(prob, candidates, limit, time_limit, strategy, spec, checkpointing)
    _check_named_strategy(prob, roles, strategy, sol.choice)
    t0 = time.perf_counter()
    pred, colls = predict(prob, sol.choice, symbolic=False, checkpointed=sol.checkpointed)
    sym, _ = predict(prob, sol.choice, symbolic=True, checkpointed=sol.checkpointed)
    t_predict = time.perf_counter() - t0
    return _make_plan(prob, env, sol, roles, len(candidates), pred, sym, colls, policy, opt, hw,
                      {"rules_seconds": t_rules, "predict_seconds": t_predict})


def _check_named_strategy(prob: Problem, roles: Roles, strategy: str, choice: dict) -> None:
    """A named strategy that splits fewer weights than it promises must say so (classics.check_promised_splits);
    "auto" promises nothing."""
    from .search.classics import check_promised_splits   # imported here: this helper's only use of it
    if strategy == "auto":
        return
    chosen = {n: prob.strategies[n].strategies[i] for n, i in choice.items() if prob.cap.info[n].kind == PARAM}
    check_promised_splits(prob.cap, roles, strategy, chosen, prob.param_bytes)


def _role_tiers(spec: MeshSpec, axis_links, hw) -> list:
    intra = [axis_links[a] == hw.intra_node_link for a in spec.axis_names]
    # if no assignment fits (e.g. a batch too small to split over every data axis),
    # the ones that leave one axis to the search
    return [role_assignments(spec, intra), role_assignments(spec, intra, num_free=1)]


def _explain_no_plan(prob, candidates, limit, time_limit, strategy, spec, checkpointing):
    free, _ = _best(prob, candidates, None, time_limit) if limit is not None else (Solution({}, (), 0, 0, ""), None)
    if limit is None or not free.choice:
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


def _pipelined_plan(cap: Captured, env: _Setting, axis: str, m: int, schedule: str) -> Plan:
    """The best plan with `axis` pipelined in `m` microbatches: the ILP lays out one microbatch on the
    other axes (the pipeline axis whole), then pipeline.partition cuts it into stages."""
    spec, strategy = env.spec, env.strategy
    if env.checkpointing == "full":
        raise PipelineError("checkpointing='full' with a pipeline is not supported yet: a pipelined plan "
                            "recomputes nothing; use checkpointing='auto' or 'none'")
    limit = _memory_limit(env.memory_limit)
    a = spec.axis_index(axis)
    p = spec.axis_sizes[a]
    rest = MeshSpec(spec.axis_names[:a] + spec.axis_names[a + 1:], spec.axis_sizes[:a] + spec.axis_sizes[a + 1:]) \
        if spec.num_axes > 1 else None
    t0 = time.perf_counter()
    prob, policy, opt, hw = _problem(cap, env, "none")
    if rest is None:
        candidates = [Roles((PIPE,), spec.axis_names, spec.axis_sizes)]
    else:
        inner = [[axis_roles(strategy, rest)]]
        if strategy == "auto" and rest.num_axes >= AUTO_BY_ROLE_AXES:
            inner = _role_tiers(rest, prob.links, hw)
        candidates = [with_pipeline(r, spec, a) for r in inner[0]]
        _check_batch_divisible(cap, spec, candidates[0])
        check_tensor_parallel_divisibility(cap, candidates[0])
    t_rules = time.perf_counter() - t0
    # the ILP sees the whole model on one device of each stage: p stages share p devices' memory
    sol, roles = _best(prob, candidates, None if limit is None else limit * p, env.time_limit)
    if not sol.choice:
        _explain_no_plan(prob, candidates, None if limit is None else limit * p, env.time_limit, strategy, spec,
                         "none")
    t0 = time.perf_counter()
    transient = float(peak_working_set(prob, sol.choice, group_redistributions(prob, sol.choice), False))
    costs = op_costs(prob, sol.choice)
    pipe = partition(prob, costs, axis=axis, microbatches=m, schedule=schedule, memory_limit=limit,
                     transient=transient)
    pred = device_prediction(prob, costs, pipe, transient)
    _, colls = predict(prob, sol.choice, symbolic=False)
    t_predict = time.perf_counter() - t0
    return _make_plan(prob, env, sol, roles, len(candidates), pred, pred, colls, policy, opt, hw,
                      {"rules_seconds": t_rules, "predict_seconds": t_predict}, pipeline=pipe)


def _make_plan(prob, env: _Setting, sol, roles, searches, pred, sym, colls, policy, opt, hw, times,
               pipeline=None) -> Plan:
    cap, spec, strategies = prob.cap, prob.mesh, prob.strategies
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
    stats = {"capture_seconds": env.t_capture, **times, "build_seconds": sol.build_seconds,
             "solve_seconds": sol.solve_seconds,
             "axis_roles": ",".join(f"{a}={r or 'any'}" for a, r in zip(spec.axis_names, roles.roles)),
             "searches": searches,
             "status": sol.status, "objective_seconds": sol.objective,
             "num_nodes": len(strategies), "num_edges": len(prob.edges),
             "num_variables": sol.num_variables, "num_constraints": sol.num_constraints,
             "mip_gap": sol.mip_gap}
    return Plan(mesh=spec, strategy=env.strategy, hardware=hw.name,
                batch_axes=tuple(spec.axis_names[a] for a in sol.batch_axes),
                node_strategies=node_strategies, param_placements=param_placements,
                input_placements=input_placements, output_placements=output_placements,
                module_paths={n: cap.info[n].module_path for n in strategies},
                collectives=records, predicted=pred, symbolic=sym,
                symbols={str(s): v for s, v in cap.hints.items()}, stats=stats, param_zero=param_zero,
                precision=policy.to_dict(), optimizer={"name": opt.name, "states_per_param": opt.states_per_param},
                checkpointed=sol.checkpointed, pipeline=pipeline)


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
                dynamic_shapes=AUTO, record_comm: bool = False, **plan_kwargs) -> ParallelModule:
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
    recapture = _recapture(capture, model, example_inputs, dynamic_shapes)
    if plan is None:
        plan = _plan_on_rank0(cap, mesh, plan_kwargs, recapture)
    if plan.pipeline is not None:   # its graph is one microbatch's
        cap = recapture(plan.pipeline.microbatches)
    _check_plan_matches(plan, cap, spec)
    _check_runtime_precision(plan, cap)
    coords = mesh.get_coordinate()
    axes = [AxisGroup(mesh.get_group(name), size, coords[i])
            for i, (name, size) in enumerate(zip(spec.axis_names, spec.axis_sizes))]
    from .runtime.collectives import CommLog
    comm = Comm(axes, CommLog() if record_comm else None)
    gm, gathered = rewrite(cap, plan, comm, needs_grad(cap))
    if plan.pipeline is None:
        other_mode = _other_mode(model, example_inputs, dynamic_shapes, cap, plan, comm)
    else:   # stages are cut from one graph; say so rather than run the other mode with the wrong one
        other_mode = ("a pipelined module runs only the graph of the mode it was parallelized in"
                      if mode_dependent_ops(cap.graph) else None)
    pm = ParallelModule(gm, gathered, cap, plan, comm, model, device_mesh=mesh, other_mode=other_mode)
    return pm.train(model.training)


def _other_mode(model, example_inputs, dynamic_shapes, cap: Captured, plan: Plan, comm):
    """The local graph for the mode the model was not captured in (eval for a training model).

    Dropout, random ops and batch norm are traced in the mode the model is in,
    so pm.eval() needs a graph of its own. The same plan lays it out: its
    nodes are the training graph's, with other arguments (dropout off). None
    when the graph has no such op (it is then the same in both modes), or a
    string saying why the other mode cannot run.
    """
    if not mode_dependent_ops(cap.graph):
        return None
    was = model.training
    try:
        model.train(not was)
        other = capture(model, example_inputs, dynamic_shapes)
    except CaptureError as e:
        return f"the model does not capture in {'eval' if was else 'train'} mode: {e}"
    finally:
        model.train(was)
    if not same_structure(cap.graph, other.graph):
        return (f"the model's graph in {'eval' if was else 'train'} mode has other ops than in the mode it was "
                "parallelized in (forward branches on self.training), so the plan does not apply to it")
    return rewrite(other, plan, comm, needs_grad(other))


def _plan_on_rank0(cap: Captured, mesh, plan_kwargs: dict, recapture) -> Plan:
    """Rank 0 plans and broadcasts the plan, so ranks cannot disagree (and plan once, not N times).

    An error on rank 0 is broadcast too and raised on every rank, so no rank
    waits forever for a plan that will not come.
    """
    import torch.distributed as dist
    known = {"hardware", "memory_limit", "strategy", "links", "time_limit", "precision", "optimizer",
             "checkpointing", "pipeline_axis", "microbatches", "schedule"}
    unknown = sorted(set(plan_kwargs) - known)
    if unknown:
        raise AutoparError(f"unknown option(s) {unknown} for autopar.parallelize; it takes plan=, "
                           f"dynamic_shapes=, record_comm= and the planning options {sorted(known)}")
    message = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", _plan_captured(cap, mesh, recapture=recapture, **plan_kwargs).to_json())
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
