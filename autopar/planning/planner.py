"""Planning: from a captured graph to the best Plan, over every search the request allows.

The order of work for one request: build the priced Problem once (cost/), search it under
each assignment of roles to mesh axes (search/ilp.py, greedy fallback), price the winner
(cost/predict.py), and -- when pipelining is asked for -- do the same per pipeline axis and
microbatch count on a graph captured at microbatch size, cut it into stages
(search/stage_partition.py), and keep the fastest plan that fits. api.py checks the user's
arguments and calls plan_captured; result.py holds what comes out.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import cost_models as cm
from cost_models.hardware import resolve_hardware

from ..capture.blocks import find_blocks
from ..capture.export import PARAM, Captured
from ..capture.gc_paused import gc_paused
from ..cost.checkpointing import checkpointable_stacks
from ..cost.float8 import float8_candidates, float8_gathered_params, float8_pays, float8_peak, float8_strategies
from ..cost.liveness import backward_start, live_sets
from ..cost.precision import optimizer_spec
from ..cost.precision import param_bytes as param_bytes_of
from ..cost.precision import precision_of
from ..cost.predict import group_redistributions, predict, transient_bytes
from ..cost.problem import Problem, build_edges
from ..cost.terms import SDPA, first_meta, needs_grad, saved_outputs
from ..errors import AutoparError, InfeasiblePlanError, MeshError, PipelineError, PlanError, ShardingError
from ..mesh import MeshSpec, mesh_spec
from ..search.classics import (ANY, CONTEXT, PIPE, Roles, axis_roles, check_context_divisibility,
                              check_promised_splits, check_tensor_parallel_divisibility, role_assignments,
                              with_pipeline)
from ..search.ilp import RoleMemo, free_search, searches_free_first, solve
from ..search.pipeline import (AUTO, MIN_STAGES_PER_DEVICE, check_depth, check_request, least_bubble,
                              microbatch_candidates, num_layers, schedule_candidates, schedule_fits,
                              stages_per_device_candidates)
from ..search.solution import INFEASIBLE, Solution
from ..search.stage_costs import device_prediction, op_basis, op_costs
from ..search.stage_partition import partition, step_floor
from ..sharding.op_spec import op_name, tensor_args
from ..sharding.strategies import all_strategies, batch_outputs
from .options import PlanOptions, reshard_after
from .result import Plan, Searched, make_plan

# progress of a search (INFO): the command line shows it; a script shows it with
# logging.basicConfig(level=logging.INFO), or logging.getLogger("autopar").setLevel(logging.INFO) and a handler
log = logging.getLogger("autopar")


def _hardware(hardware, mesh):
    """(Hardware, per-axis links) from `hardware=`: a preset name, a cost_models.Hardware, or a spec (a dict or
    the path of a JSON file, as autopar.calibrate writes) or a Calibration, which carry measured links per mesh
    axis name."""
    default = "h100"
    if hasattr(mesh, "device_type") and mesh.device_type == "cpu":
        default = "cpu-gloo"   # a CPU mesh runs gloo (cost_models.hardware: its measured links)
    try:
        return resolve_hardware(hardware, default=default)
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


def plan_captured(cap: Captured, mesh, options: PlanOptions | None = None, *, t_capture=0.0, tie_blocks=True,
                  recapture=None, problems: dict | None = None, **keywords) -> Plan:
    """The plan for a captured model. `recapture(m)` captures it again with batches of 1/m the size,
    which a pipelined plan is made for (its graph runs one microbatch at a time); without it the
    search does not pipeline. `problems`: a dict that several calls with the same capture and options
    but another strategy share (autopar.compare), so the priced problem is built and priced once.

    Python's cyclic collector is paused meanwhile (capture/gc_paused.py): the search's tables of every op
    (~10k on a 126-layer model) would make it walk the capture's millions of objects again and again."""
    with gc_paused():
        return _plan_captured(cap, mesh, options, t_capture=t_capture, tie_blocks=tie_blocks, recapture=recapture,
                              problems=problems, **keywords)


def _plan_captured(cap: Captured, mesh, options: PlanOptions | None = None, *, t_capture=0.0, tie_blocks=True,
                   recapture=None, problems: dict | None = None, **keywords) -> Plan:
    if options is not None and keywords:
        raise AutoparError(f"plan_captured takes its options as a PlanOptions or as keywords, not both: "
                           f"{sorted(keywords)}")
    opts = options.checked() if options is not None else PlanOptions.from_keywords("plan_captured", keywords)
    spec = mesh_spec(mesh)
    strategy, pipeline_axis, microbatches, schedule = opts.strategy, opts.pipeline_axis, opts.microbatches, opts.schedule
    check_request(spec, pipeline_axis, microbatches, schedule, _batch_size(cap), opts.stages_per_device)
    env = Request(cap, spec, mesh, opts, t_capture, tie_blocks, reshard_after(strategy, opts.reshard_after_forward),
                  {} if problems is None else problems)
    axes = _pipeline_axes(cap, spec, strategy, pipeline_axis, schedule, opts.stages_per_device) \
        if recapture is not None else []
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
    depth = _depth(cap)
    for axis in axes:
        p = spec.axis_sizes[spec.axis_index(axis)]
        for m in microbatch_candidates(p, _batch_size(cap) or 1, microbatches):
            # a pipeline idles a share of the step, (p-1)/m at most, (p-1)/(3m) under zero bubble, (p-1)/(v m)
            # interleaved: no faster than the serial compute spread over every device, stretched by the least
            least = least_bubble(schedule_candidates(schedule), p, m, depth, opts.stages_per_device)
            if bound is not None and best.predicted.step_time <= bound * (1 + least):
                continue
            captured = None
            for sched in schedule_candidates(schedule):
                why = schedule_fits(sched, p, m)   # torch's schedules refuse these at the first step
                if why is not None:
                    if microbatches is not None and schedule != AUTO:
                        raise PipelineError(f"microbatches={m} on axis {axis!r}: {why} (or use schedule='gpipe')")
                    continue
                if MIN_STAGES_PER_DEVICE[sched] * p > depth:
                    continue   # interleaving under "auto", on a model too shallow for it
                try:
                    captured = captured or recapture(m)
                    found = _pipelined_plan(captured, env, axis, m, sched)
                except (PipelineError, InfeasiblePlanError, ShardingError) as e:
                    if pipeline_axis not in (None, "auto") and microbatches is not None and schedule != AUTO:
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
class Request:
    """What every search of one planning request shares."""
    cap: Captured
    spec: MeshSpec
    mesh: object          # as given: a DeviceMesh's device type picks the default hardware
    options: PlanOptions  # checked (PlanOptions.checked)
    t_capture: float
    tie_blocks: bool
    reshard_after_forward: bool | None   # Problem.reshard_after_forward (None: the search decides)
    problems: dict        # (what a Problem is built from) -> (the capture, the Problem, ...): see _problem


def _batch_size(cap: Captured):
    meta = first_meta(cap.info[cap.input_names[0]].meta) if cap.input_names else None
    return meta.hint[0] if meta is not None and meta.ndim > 0 else None


def _pipeline_axes(cap: Captured, spec: MeshSpec, strategy: str, pipeline_axis, schedule, stages_per_device) -> list:
    """Axes to try pipelining over: the one named, or under "auto" every axis the model has the layers for."""
    if pipeline_axis is None:
        return []
    per_device = min(MIN_STAGES_PER_DEVICE[s] for s in schedule_candidates(schedule))
    if stages_per_device is not None and schedule != AUTO:   # pinned, interleaved (check_request)
        per_device = stages_per_device
    if pipeline_axis != "auto":
        check_depth(cap, spec.axis_sizes[spec.axis_index(pipeline_axis)] * per_device, pipeline_axis)
        return [pipeline_axis]
    if strategy != "auto":
        return []
    layers = _depth(cap)
    return [name for name, size in zip(spec.axis_names, spec.axis_sizes) if 1 < size and size * per_device <= layers]


def _depth(cap: Captured) -> int:
    """Layers of the model's deepest stack: no more stages than that."""
    return max(num_layers(cap).values(), default=1)


def _serial_time(plan: Plan, spec: MeshSpec) -> float:
    """A floor on any plan's step: the plan's compute as if every device did an equal share, no comm.
    (The plan's compute is per device; the devices that split the batch share the work.)"""
    shards = 1
    for a in plan.batch_axes:
        shards *= spec.axis_sizes[spec.axis_index(a)]
    return plan.predicted.compute_time * shards / spec.num_devices


# whether activations gathered whole for an op that keeps them are kept as shards and gathered again in
# backward: as Megatron does under sequence parallelism, whose point is memory; for "auto", the search's
# choice under a memory limit (ilp.solve); for the other named strategies, never (it only costs time)
REGATHER = {"tp+sp": True, "auto": None}


def _problem(cap: Captured, env: Request, checkpointing: str):
    """(Problem, precision policy, optimizer spec, hardware) for a search under `env`'s strategy. The Problem's
    candidates, edges, activation model and memoised prices depend on the capture and options but not on
    the strategy, so requests that share `env.problems` build them once and share the prices."""
    key = (id(cap), checkpointing != "none", env.spec, repr(env.options.hardware), repr(env.options.precision), repr(env.options.optimizer),
           repr(env.options.links), env.tie_blocks, env.options.bucket_bytes, repr(env.mesh))
    entry = env.problems.get(key)
    if entry is None or entry[0] is not cap:   # (an id outlives its object: the capture itself must match)
        entry = env.problems[key] = (cap, *_base_problem(cap, env, checkpointing))
    _, base, policy, opt, hw = entry
    prob = replace(base, regather_activations=REGATHER.get(env.options.strategy, False),
                   reshard_after_forward=env.reshard_after_forward)
    return prob, policy, opt, hw


def _base_problem(cap: Captured, env: Request, checkpointing: str):
    spec = env.spec
    policy, opt = precision_of(env.options.precision), optimizer_spec(env.options.optimizer)
    # bytes from the dtype the model holds a parameter in: a graph traced at the compute dtype shows that one
    # and a frozen one (Captured.frozen_params) has no gradient and no optimizer state
    param_bytes = {n: param_bytes_of(policy, opt, cap.param_dtypes.get(i.target_name, first_meta(i.meta).dtype),
                                     trainable=i.target_name not in cap.frozen_params)
                   for n, i in cap.info.items() if i.kind == PARAM}
    # the graph must be the one that runs: traced at the compute dtype (capture/compute_dtype.py)
    traced = {first_meta(i.meta).dtype for i in cap.info.values()
              if i.kind == PARAM and first_meta(i.meta).dtype.is_floating_point}
    if policy.compute is not None and not traced <= {policy.compute}:
        raise PlanError(f"the graph was traced with {sorted(map(str, traced))} weights, not the policy's compute dtype "
                        f"{policy.compute}: capture it with capture.compute_dtype.at_compute_dtype, as autopar.plan does")
    hw, measured = _hardware(env.options.hardware, env.mesh)
    # a spec's links serve the axes of the same name; links= still overrides any axis
    links = {**{a: link for a, link in measured.items() if a in spec.axis_names}, **(env.options.links or {})}
    try:
        axis_links = cm.axis_links(list(zip(spec.axis_names, spec.axis_sizes)), hw, links)
    except cm.CostModelError as e:
        raise MeshError(str(e)) from e
    float8 = float8_linears(cap, policy, hw, spec)
    canonical = find_blocks(cap).canonical if env.tie_blocks else {}
    # a repeated block's linear that runs in another precision than its first copy's (filter_fqns naming one
    # layer) is priced and laid out on its own: tied, it would take the first copy's layouts and prices
    canonical = {n: first for n, first in canonical.items() if (n in float8) == (first in float8)}
    strategies = all_strategies(cap, spec, same_as=canonical)
    strategies = float8_strategies(strategies, float8)
    grad_nodes = needs_grad(cap)
    prob = Problem(cap, spec, axis_links, hw, strategies, build_edges(cap, strategies),
                   grad_nodes, saved_outputs(cap, hw), param_bytes, canonical, live_sets(cap),
                   backward_start=backward_start(cap, grad_nodes),
                   stacks=checkpointable_stacks(cap, hw) if checkpointing != "none" else (),
                   bucket_bytes=env.options.bucket_bytes, float8=float8,
                   float8_recipe=policy.float8.recipe_name if policy.float8 is not None else "tensorwise",
                   float8_gathered=float8_gathered_params(cap, float8, policy.float8))
    return prob, policy, opt, hw


def float8_linears(cap: Captured, policy, hw, spec: MeshSpec) -> dict:
    """{linear node: (K, N)} of the linears the precision policy runs in float8 (cost/float8.py's rule); {}
    without float8. PlanError where the hardware has no float8 peak (cost/float8.float8_peak): priced at
    another dtype's rate, a float8 plan would be a guess, and on an A100 it could not run.

    Under auto-fp8 (Float8.auto_filter_small_kn) only those float8 pays for on `hw` (cost/float8.float8_pays).
    That is decided once, before the search lays anything out, so at the linear's whole weight and its
    tokens (batch x sequence at the example's sizes) divided evenly over all the mesh's devices: the work a
    device does under data parallelism. Other layouts split the work differently (tensor parallelism splits
    the weight, a pipeline axis no tokens), which moves the casts' share but not, at the sizes where it
    matters, which side of the line a linear falls on."""
    if policy.float8 is None:
        return {}
    float8_peak(hw)
    eligible, _ = float8_candidates(cap, policy.float8)
    if not policy.float8.auto_filter_small_kn:
        return eligible
    devices = math.prod(spec.axis_sizes)
    kept = {}
    for name, (k, n) in eligible.items():
        x = first_meta(cap.info[tensor_args(cap.node(name))[0].name].meta)
        tokens = max(math.prod(x.hint) // k // devices, 1)
        if float8_pays(tokens, k, n, x.itemsize, str(x.dtype).removeprefix("torch."), hw):
            kept[name] = (k, n)
    return kept


def _flat_plan(cap: Captured, env: Request) -> Plan:
    spec, strategy, checkpointing, time_limit = (env.spec, env.options.strategy, env.options.checkpointing,
                                                 env.options.time_limit)
    limit = _memory_limit(env.options.memory_limit)
    roles = axis_roles(strategy, spec, env.options.context_weights)
    _check_batch_divisible(cap, spec, roles)
    check_tensor_parallel_divisibility(cap, roles)
    check_context_divisibility(cap, roles)
    log.info("strategy %s: sharding rules (the layouts each op may take)", strategy)
    t0 = time.perf_counter()
    prob, policy, opt, hw = _problem(cap, env, checkpointing)
    if checkpointing in ("full", "per-op", "per-layer") and not prob.stacks:
        raise PlanError(f"checkpointing={checkpointing!r} found no stack of repeated blocks to checkpoint (an "
                        "nn.ModuleList of 2+ layers whose ops run one layer after another); use "
                        "checkpointing='auto' or 'none'")
    if checkpointing == "selective" and not any(st.kind == "selective" for st in prob.stacks):
        raise PlanError("checkpointing='selective' found no stack of repeated blocks with an attention core to "
                        "recompute (two matmuls of activations, scores and weighted values, or a fused attention "
                        "op, in each block of an nn.ModuleList of 2+ layers); use checkpointing='full', 'auto' "
                        "or 'none'")
    t_rules = time.perf_counter() - t0
    log.info("strategy %s: %d nodes, %d layouts to choose from; searching (ILP, %s per solve)", strategy,
             len(prob.strategies), sum(len(ns.strategies) for ns in prob.strategies.values()),
             "no time limit" if time_limit is None else f"at most {time_limit:.0f} s")
    tiers = [[roles]]
    if strategy == "auto" and spec.num_axes >= AUTO_BY_ROLE_AXES:
        tiers = _role_tiers(spec, prob.links, hw)
    for candidates in tiers:
        sol, roles = _best(prob, candidates, limit, time_limit, checkpointing=checkpointing)
        if sol.choice:
            break
    if strategy == "auto" and _wants_context(prob, sol, limit):
        sol, roles, candidates = _with_context(prob, sol, roles, candidates, limit, time_limit, checkpointing,
                                               env.options.context_weights or ANY)
    if not sol.choice:
        _explain_no_plan(prob, candidates, limit, time_limit, strategy, spec, checkpointing)
    _check_named_strategy(prob, roles, strategy, sol.choice)
    # id(solution) -> (solution, (numeric prediction, collectives)) of the solutions _against_named predicted
    predictions: dict = {}
    if strategy == "auto" and sol.choice:
        sol, roles = _against_named(prob, sol, roles, limit, time_limit, checkpointing, predictions)
    log.info("strategy %s: searched in %.1f s (%s); predicting", strategy, sol.solve_seconds + sol.build_seconds,
             sol.status)
    t0 = time.perf_counter()
    # as the solution was priced
    prob = replace(prob, regather_activations=sol.regather_activations, reshard_after_forward=sol.reshard_after_forward)
    known = predictions.get(id(sol))
    pred, colls = known[1] if known is not None and known[0] is sol else \
        predict(prob, sol.choice, symbolic=False, checkpointed=sol.checkpointed)
    sym, _ = predict(prob, sol.choice, symbolic=True, checkpointed=sol.checkpointed)
    t_predict = time.perf_counter() - t0
    searched = Searched(prob, sol, roles, len(candidates), pred, sym, colls, policy, opt, hw,
                        {"rules_seconds": t_rules, "predict_seconds": t_predict})
    return make_plan(searched, env.options.strategy, env.t_capture)


def _wants_context(prob: Problem, sol, limit) -> bool:
    """Whether auto also searches with a context axis: under a memory limit no plan of its own meets, in a
    model with attention. Context parallelism buys activation memory (each rank keeps its rows of the
    sequence) with communication in every layer, and as built it runs a causal attention's split rows with
    a mask, twice the causal kernel's work (runtime/lowering/context_parallel.py): where a plan fits, even
    by recomputing, it has not been faster in any case measured (benchmarks/context_parallel.py), and
    searching it costs as much again. A plan that recomputes says so instead (stats["context"])."""
    if limit is None or not any(n.op == "call_function" and op_name(n) == SDPA for n in prob.cap.graph.nodes):
        return False
    if sol.choice and any(kind != "none" for kind in sol.checkpointed.values()):
        sol.context = ("not tried: auto searches a context axis only where no plan fits; compare "
                       "strategy='cp' or 'fsdp+cp' (autopar.compare)")
    return not sol.choice


def _with_context(prob: Problem, sol, roles: Roles, candidates: list, limit, time_limit, checkpointing,
                  context_weights: str):
    """(solution, roles, candidates searched): the better of `sol` and the plans with one axis in the
    context role, the others as `roles` give them (free, on a mesh auto searches whole). There weights are
    stored as `context_weights` says (classics.Roles; by default the search chooses per weight, split ones
    gathered whole for use, as torchtitan shards them over its cp ranks too). An axis the
    sequence does not divide is left out; the plan's stats say what was tried (stats["context"])."""
    spec = prob.mesh
    tried = []
    for a in range(spec.num_axes):
        if spec.axis_sizes[a] < 2 or roles.roles[a] == PIPE:
            continue
        cp = Roles(roles.roles[:a] + (CONTEXT,) + roles.roles[a + 1:], spec.axis_names, spec.axis_sizes,
                   roles.sequence_parallel, context_weights)
        try:
            check_context_divisibility(prob.cap, cp)
        except ShardingError:
            continue
        tried.append(cp)
    if not tried:
        sol.context = "not tried: no mesh axis divides the sequence"
        return sol, roles, candidates
    names = ", ".join(spec.axis_names[r.roles.index(CONTEXT)] for r in tried)
    log.info("no plan fits; searching again with a context axis (%s)", names)
    found, found_roles = _best(prob, tried, limit, time_limit, checkpointing=checkpointing)
    if found.choice and (not sol.choice or found.objective < sol.objective):
        found.solve_seconds += sol.solve_seconds
        found.build_seconds += sol.build_seconds
        found.context = (f"chosen: a context axis ({names} tried) beats the best plan without one" if sol.choice
                         else f"chosen: no plan fits without a context axis ({names} tried)")
        return found, found_roles, tried
    why = "no plan with one fits" if not found.choice else (
        f"the best with one ({found.objective * 1e3:.4g} ms) is slower than without ({sol.objective * 1e3:.4g} ms)")
    sol.context = f"not chosen: a context axis on {names} was tried; {why}"
    sol.solve_seconds += found.solve_seconds
    sol.build_seconds += found.build_seconds
    return sol, roles, candidates


# the named strategies auto's answer is held against (_against_named): those whose collectives the search prices
# as waited for and the prediction hides behind compute (FSDP's gathers and reduce-scatters, overlap.py)
HELD_AGAINST = ("fsdp", "fsdp+tp")


def _predicted(prob: Problem, sol, predictions: dict | None = None):
    """The numeric prediction of `sol`, as _flat_plan makes it; kept in `predictions` (id(sol) -> (sol,
    (prediction, collectives))) for _flat_plan to reuse for the plan it returns."""
    priced = replace(prob, regather_activations=sol.regather_activations,
                     reshard_after_forward=sol.reshard_after_forward)   # as the solution was priced
    found = predict(priced, sol.choice, symbolic=False, checkpointed=sol.checkpointed)
    if predictions is not None:
        predictions[id(sol)] = (sol, found)
    return found[0]


def _against_named(prob: Problem, sol, roles: Roles, limit, time_limit, checkpointing, predictions=None):
    """(solution, roles): auto's answer, or the plan of a named strategy in HELD_AGAINST that the prediction
    finds faster. The search prices every collective as waited for, where the prediction hides FSDP's gathers
    behind the layers before them (cost/overlap.py), so the search can take a plan that replicates weights over
    one that shards them and is faster as predicted (torchtitan's 8B on 8 GPUs: 1.3% slower). A named
    strategy's plan lies in auto's space; holding the answer against the few that overlap favours keeps auto
    no slower than them, at one more search each; a named plan the prediction puts over the limit is not taken.
    The plan's stats say what was compared (stats["named"])."""
    spec = prob.mesh
    if not prob.hardware.comm_overlaps_compute or spec.num_devices < 2:
        return sol, roles   # nothing hides: the search prices the collectives as the prediction does
    if sol.context.startswith("chosen"):
        return sol, roles   # no plan without a context axis is faster, or fits at all (_with_context)
    own = _predicted(prob, sol, predictions).step_time
    best = (own, "auto's own search", sol, roles)
    tried = []
    for name in HELD_AGAINST:
        if name == "fsdp+tp" and spec.num_axes < 2:
            continue
        try:
            named = axis_roles(name, spec)
            _check_batch_divisible(prob.cap, spec, named)
            check_tensor_parallel_divisibility(prob.cap, named)
            found, _ = _best(prob, [named], limit, time_limit, checkpointing=checkpointing)
        except (ShardingError, InfeasiblePlanError, PlanError):   # e.g. a tp degree the heads do not divide
            tried.append(f"{name} no plan")
            continue
        sol.solve_seconds += found.solve_seconds
        sol.build_seconds += found.build_seconds
        if not found.choice:
            tried.append(f"{name} no plan")
            continue
        pred = _predicted(prob, found, predictions)
        step = pred.step_time
        tried.append(f"{name} {step * 1e3:.5g} ms")
        if step < best[0] and (limit is None or pred.memory.total <= limit):
            best = (step, f"{name}'s plan", found, named)
    _, won, chosen, chosen_roles = best
    if chosen is not sol:   # the time spent searching, all of it
        chosen.solve_seconds, chosen.build_seconds = sol.solve_seconds, sol.build_seconds
        if any(kind != "none" for kind in chosen.checkpointed.values()):
            chosen.context = sol.context   # _wants_context's note on a plan that recomputes
    chosen.named = f"held against {', '.join(tried)} (predicted steps; auto's own {own * 1e3:.5g} ms): {won} chosen"
    return chosen, chosen_roles


def _check_named_strategy(prob: Problem, roles: Roles, strategy: str, choice: dict) -> None:
    """A named strategy that splits fewer weights than it promises must say so (classics.check_promised_splits);
    "auto" promises nothing."""
    if strategy == "auto":
        return
    chosen = {n: prob.strategies[n].strategies[i] for n, i in choice.items() if prob.cap.info[n].kind == PARAM}
    check_promised_splits(prob.cap, roles, strategy, chosen, prob.param_bytes)


def _role_tiers(spec: MeshSpec, axis_links, hw) -> list:
    intra = [axis_links[a] == hw.intra_node_link for a in spec.axis_names]
    # if no assignment fits (e.g. a batch too small to split over every data axis),
    # the ones that leave one axis to the search
    return [role_assignments(spec, intra), role_assignments(spec, intra, num_free=1)]


def _context_hint(candidates: list) -> str:
    """Under a context role every activation must split along something other than its batch: a model with no
    sequence (an MLP over vectors) has nothing to split there."""
    if not any(CONTEXT in roles.roles for roles in candidates):
        return ""
    return ("; a context axis splits every activation along a dim other than its batch (the sequence), "
            "which this model may not have")


def _whole_outputs_hint(cap: Captured) -> str:
    """Outputs computed from the batch that do not carry it (a mean over the batch, say) must come back
    whole, which a strategy that splits the batch and never gathers activations cannot do."""
    out = next(n for n in cap.graph.nodes if n.op == "output")
    _, whole = batch_outputs(out, cap)
    if not whole:
        return ""
    metas = {name: first_meta(cap.info[name].meta) for name in sorted(whole)}
    shapes = ", ".join(f"{name} {tuple(m.hint) if m is not None else '(shape unknown)'}" for name, m in metas.items())
    return (f", or some output is computed from the batch but is not split by it ({shapes}: dim 0 is not the "
            "batch), so it must come back whole, which needs the batch gathered: return it per sample, or "
            "compute it in the loss")


def _explain_no_plan(prob, candidates, limit, time_limit, strategy, spec, checkpointing):
    free, _ = _best(prob, candidates, None, time_limit) if limit is not None else (Solution({}, (), 0, 0, ""), None)
    if limit is None or not free.choice:
        raise ShardingError(
            f"strategy {strategy!r} cannot be laid out on mesh {spec}: some tensor dim does not divide by "
            "the axis sizes it must be split over (e.g. heads or hidden size vs the tensor-parallel degree)"
            f"{_whole_outputs_hint(prob.cap)}{_context_hint(candidates)}; use strategy='auto', another mesh, or "
            "sizes divisible by the axis sizes")
    least, _ = _best(prob, candidates, None, time_limit, minimize_memory=True, checkpointing=checkpointing)
    raise InfeasiblePlanError(
        f"no {strategy!r} plan on mesh {spec} fits memory_limit={cm.format_bytes(limit)} per device: "
        f"the smallest any such plan needs is {cm.format_bytes(least.objective)} "
        f"({least.objective:.0f} bytes). Raise the limit, add devices, or try another strategy.",
        min_memory_bytes=least.objective)


def _pipelined_plan(cap: Captured, env: Request, axis: str, m: int, schedule: str) -> Plan:
    """The best plan with `axis` pipelined in `m` microbatches: the ILP lays out one microbatch on the
    other axes (the pipeline axis whole), then stage_partition.partition cuts it into stages."""
    spec, strategy, checkpointing = env.spec, env.options.strategy, env.options.checkpointing
    limit = _memory_limit(env.options.memory_limit)
    a = spec.axis_index(axis)
    p = spec.axis_sizes[a]
    rest = MeshSpec(spec.axis_names[:a] + spec.axis_names[a + 1:], spec.axis_sizes[:a] + spec.axis_sizes[a + 1:]) \
        if spec.num_axes > 1 else None
    log.info("strategy %s: pipelined over %s in %d microbatches (%s)", strategy, axis, m, schedule)
    t0 = time.perf_counter()
    prob, policy, opt, hw = _problem(cap, env, checkpointing)
    recomputable = _stack_sets(prob, checkpointing, limit)
    # the runtime groups no FSDP layers across stages (cost/layer_groups.py). Under a pipeline FSDP either gathers
    # a weight per microbatch (resharded: priced as such) or once per step, held whole across the microbatches
    # (reshard_after_forward=False: op_costs(held=True) prices the gathers and the weights held; the activations
    # keep no weight per microbatch either way, so the problem prices them resharded)
    prob = replace(prob, pipelined=True, reshard_after_forward=True)
    if rest is None:
        candidates = [Roles((PIPE,), spec.axis_names, spec.axis_sizes)]
    else:
        inner = [[axis_roles(strategy, rest, env.options.context_weights)]]
        if strategy == "auto" and rest.num_axes >= AUTO_BY_ROLE_AXES:
            inner = _role_tiers(rest, prob.links, hw)
        candidates = [with_pipeline(r, spec, a) for r in inner[0]]
        _check_batch_divisible(cap, spec, candidates[0])
        check_tensor_parallel_divisibility(cap, candidates[0])
        check_context_divisibility(cap, candidates[0])
    t_rules = time.perf_counter() - t0
    # the ILP sees the whole model on one device of each stage: p stages share p devices' memory
    # the ILP lays out one microbatch's ops (no stacks: which blocks recompute is decided with the cut, below)
    sol, roles = _best(replace(prob, stacks=()), candidates, None if limit is None else limit * p,
                       env.options.time_limit)
    if not sol.choice:
        _explain_no_plan(replace(prob, stacks=()), candidates, None if limit is None else limit * p,
                         env.options.time_limit, strategy, spec,
                         "none")
    t0 = time.perf_counter()
    prob = replace(prob, regather_activations=sol.regather_activations)   # as the solution was priced
    pipe, pred, held, stacks = _cut_each(prob, sol, env, recomputable, axis, m, schedule, limit)
    sol = replace(sol, reshard_after_forward=not held, checkpointed={st.path: st.kind for st in stacks})
    _, colls = predict(prob, sol.choice, symbolic=False)
    t_predict = time.perf_counter() - t0
    log.debug("pipeline over %s, %d microbatches (%s): cut and priced in %.2f s", axis, m, schedule, t_predict,
              extra={"stage": {"stage": "pipeline", "axis": axis, "microbatches": m, "schedule": schedule,
                               "seconds": t_predict}})
    searched = Searched(prob, sol, roles, len(candidates), pred, pred, colls, policy, opt, hw,
                        {"rules_seconds": t_rules, "predict_seconds": t_predict}, pipeline=pipe)
    return make_plan(searched, env.options.strategy, env.t_capture)


def _stack_sets(prob: Problem, checkpointing: str, limit) -> list:
    """The sets of stacks a pipelined plan may recompute: the one the mode names; under "auto" none first, then,
    when there is a limit to meet, each kind alike on every stack (recomputing only costs time)."""
    def of(kind):
        return tuple(st for st in prob.stacks if st.kind == kind)
    if checkpointing == "none":
        return [()]
    if checkpointing != "auto":
        if not of(checkpointing):
            raise PlanError(f"checkpointing={checkpointing!r} found no stack of repeated blocks to checkpoint that way "
                            "(an nn.ModuleList of 2+ layers whose ops run one layer after another); use "
                            "checkpointing='auto' or 'none'")
        return [of(checkpointing)]
    kinds = ("selective", "per-op", "full") if limit is not None else ()
    return [()] + [of(k) for k in kinds if of(k)]


def _cut_each(prob: Problem, sol, env: Request, recomputable: list, axis: str, m: int, schedule: str, limit):
    """_cut_stages over the virtual stages per device the schedule may run (one but under interleaving,
    search/pipeline.stages_per_device_candidates)."""
    p = env.spec.axis_sizes[env.spec.axis_index(axis)]
    per_device = stages_per_device_candidates(schedule, p, _depth(prob.cap), env.options.stages_per_device)
    # unasked, FSDP under a pipeline is searched both ways even for a named strategy (PlanOptions): resharding
    # gathers every weight once per microbatch, so practitioners keep weights whole there (torchtitan:
    # reshard_after_forward = not pipelined), and the resharded way is what the search takes where that is
    # what fits
    reshard = None if env.options.reshard_after_forward is None else env.reshard_after_forward
    return _cut_stages(prob, sol, reshard, recomputable, axis, m, schedule, limit, per_device)


def _cut_stages(prob: Problem, sol, reshard_after_forward, recomputable: list, axis: str, m: int, schedule: str,
                limit, stages_per_device=(1,)):
    """(pipeline, prediction, held, stacks recomputed) of the fastest way to run the stages that fits `limit`:
    for each set of stacks to recompute, FSDP weights gathered per microbatch (resharded) or once per step and
    held (reshard_after_forward=False), both when the request leaves it to the search (None), each cut with
    every count of stages per device in `stages_per_device` (the costs of the ops are priced once for all of
    them: on a 126-layer model that pricing takes seconds, the cut a fraction). Raises the first failure only
    if nothing fits. Held weights combine with recompute: a checkpointed block reads the held whole
    weight in forward and in its rerun (runtime/pipeline/held_weights.py), as torchtitan runs its 405B Llama."""
    ways = {True: [False], False: [True], None: [False, True]}[reshard_after_forward]
    p = prob.mesh.axis_sizes[prob.mesh.axis_index(axis)]
    groups = group_redistributions(prob, sol.choice)
    basis = op_basis(prob, sol.choice, groups)   # what the op costs share over stacks recomputed and held
    tries = []   # (no cut steps faster, the order the ways are listed in, stacks, held, costs, v, transient)
    for stacks in recomputable:
        transient = float(transient_bytes(prob, sol.choice, groups, stacks, False))
        for held in ways:
            costs = op_costs(prob, basis, held=held, stacks=stacks)
            for v in stages_per_device:
                tries.append((step_floor(costs, p, v, m, schedule), len(tries), stacks, held, costs, v, transient))
    # the fastest plan, of equally fast ones the first listed: cut where the floor is lowest first, so that a plan
    # that fits soon rules out every way whose floor it beats (no cut of those can be faster: step_floor); on a
    # 405B Llama, every way that gathers FSDP weights per microbatch, whose floor is twice a held plan's step
    best, failure = None, None   # (pipe, prediction, held, stacks, order), (order, the error)
    for floor, k, stacks, held, costs, v, transient in sorted(tries, key=lambda t: t[:2]):
        if best is not None and (floor, k) > (best[1].step_time, best[4]):
            break   # nor can any later: their floors are higher
        try:
            pipe = partition(prob, costs, axis=axis, microbatches=m, schedule=schedule, stages_per_device=v,
                             memory_limit=limit, transient=transient)
        except PipelineError as e:
            failure = min(failure or (k, e), (k, e), key=lambda f: f[0])
            continue
        pred = device_prediction(prob, costs, pipe, transient)
        if best is None or (pred.step_time, k) < (best[1].step_time, best[4]):
            best = (pipe, pred, held, stacks, k)
    if best is None:
        raise failure[1]   # the first listed way's
    return best[:4]


# from this many mesh axes on, `auto` fixes each axis's role first (classics.role_assignments):
# one search over every layout on 3+ axes grows too large to solve in seconds
AUTO_BY_ROLE_AXES = 3


def _best(prob: Problem, candidates: list, limit, time_limit, minimize_memory=False, checkpointing="none"):
    """The best solution over several role assignments (the first assignment's if none solves; of equally
    good ones, the first).

    Where solve starts each assignment with the fastest plan under no limit (ilp.searches_free_first),
    those come first, for every assignment: each is a lower bound on its assignment's answer, so the
    assignments are then searched under the limit from the lowest bound up, and one whose bound the best
    plan so far already beats is not searched again (on a 3-axis mesh, most of them)."""
    gap = 1e-6 if minimize_memory else 1e-3
    bounded = len(candidates) > 1 and searches_free_first(prob, limit, minimize_memory, checkpointing)
    free: dict = {}   # candidate index -> its free_search answer
    # what the free search of the candidate with the lowest bound priced (ilp.RoleMemo), for its searches under
    # the limit; one only: on 4 axes a memo holds ~1M priced pairs, and that candidate is searched first
    memos: dict = {}
    usable = []
    seconds = [0.0, 0.0]   # solve, build

    def count(sol):
        seconds[0] += sol.solve_seconds
        seconds[1] += sol.build_seconds

    def bound(i):   # no plan under candidate i's roles is faster: HiGHS's proven bound on its optimum
        if not bounded:
            return 0.0
        if free[i].choice:
            return free[i].objective * (1 - free[i].mip_gap)
        return float("inf") if free[i].status == INFEASIBLE else 0.0   # no layout at all / out of time: no bound

    for i, roles in enumerate(candidates):
        if len(candidates) > 1:
            log.info("search %d/%d: %s", i + 1, len(candidates), ",".join(
                f"{a}={r or 'any'}" for a, r in zip(roles.axis_names, roles.roles)))
        try:
            if len(candidates) > 1:   # a batch the roles' data axes cannot divide: no layout (no input splits so)
                _check_batch_divisible(prob.cap, prob.mesh, roles)
            if bounded:
                memo = RoleMemo()
                free[i] = free_search(prob, roles, time_limit, gap, memo)
                count(free[i])
                if not memos or (bound(i), i) < min((bound(k), k) for k in memos):
                    memos = {i: memo}
        except (ShardingError, InfeasiblePlanError):   # these roles cannot lay out some node
            if len(candidates) == 1:
                raise
            continue
        usable.append(i)

    best = None
    for i in sorted(usable, key=lambda i: (bound(i), i)) if bounded else usable:
        if best is not None and (bound(i), i) >= (best[0].objective, best[2]):
            continue   # no faster than the best so far (or as fast, and later in order): never chosen
        try:
            sol = solve(prob, candidates[i], limit, time_limit, minimize_memory=minimize_memory, gap=gap,
                        checkpointing=checkpointing, free=free.get(i), memo=memos.pop(i, None))
        except (ShardingError, InfeasiblePlanError):
            if len(candidates) == 1:
                raise
            continue
        if sol is not free.get(i):
            count(sol)
        if sol.choice and (best is None or (sol.objective, i) < (best[0].objective, best[2])):
            best = (sol, candidates[i], i)
    if best is None:
        return Solution({}, (), float("inf"), seconds[0], INFEASIBLE, build_seconds=seconds[1]), candidates[0]
    sol, roles, _ = best
    sol.solve_seconds, sol.build_seconds = seconds
    return sol, roles
