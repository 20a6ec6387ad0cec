"""The public entry points: autopar.plan and autopar.compare (offline), autopar.parallelize (on every rank)."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import replace

import torch

from ._compat import trace_lock
from .capture.compute_dtype import at_compute_dtype
from .capture.export import AUTO, PARAM, Captured, capture
from .capture.microbatch import microbatch_of
from .capture.modes import mode_dependent, same_ops, without_identities
from .capture.repeat import capture_repeated
from .capture.shared import shared_in_run
from .cost.precision import precision_of
from .cost.terms import first_meta, needs_grad
from .errors import AutoparError, CaptureError, MeshError, PlanError
from .mesh import MeshSpec, mesh_spec
from .planning.result import Plan
from .planning.options import PlanOptions
from .planning.lowering import lowering_key, lowering_of
from .planning.schedule import schedule_of, stage_cut
from .planning.planner import plan_captured
from .planning.progress import shown
from .runtime.collectives import AxisGroup, Comm
from .runtime.devices import mesh_device
from .runtime.module import OtherMode, ParallelModule
from .runtime.lowering.rewrite import rewrite
from .runtime.rng import RandomStreams, agreed_seed
from .search.classics import CONTEXT_STRATEGIES, STRATEGIES
from .search.pipeline import check_request

log = logging.getLogger("autopar")   # progress (INFO), as planning/planner.py's


def plan(model: torch.nn.Module, example_inputs, mesh, *, example_kwargs: dict | None = None,
         dynamic_shapes=AUTO, trace_every_layer: bool = False, progress: bool | None = None, **options) -> Plan:
    """Plan how to split `model` over `mesh`, without running it or touching a process group.

    `mesh` is a DeviceMesh with named axes or a mapping {axis_name: size}; the
    model may live on the meta device. The model is called as
    `model(*example_inputs, **example_kwargs)`: keyword inputs as torch.export's
    `kwargs` (how Hugging Face models are called: `example_kwargs=batch`); each
    input is one tensor, or a Python constant (a flag, None) that the plan
    keeps as given. `options` are autopar.PlanOptions' fields (hardware,
    memory_limit, strategy, precision, optimizer, checkpointing, links,
    time_limit, pipeline_axis, microbatches, schedule, stages_per_device, bucket_bytes,
    reshard_after_forward), each documented there with its default.
    The model is traced with each stack of alike layers (an nn.ModuleList of
    one class, same parameter shapes) cut to three, the rest copied from the
    last (autopar.capture.repeat), so depth adds little time. `trace_every_layer=True`
    traces every layer, for a model whose alike layers run different code
    (e.g. a per-layer attention type in its config).
    `progress`: None (the default) writes what planning is doing to stderr when that is a terminal and
    planning has taken over 2 s, so a quick plan or a log stays quiet; True always, False never
    (autopar/planning/progress.py).
    See docs/ARCHITECTURE.md.
    """
    opts = PlanOptions.from_keywords("autopar.plan", options,   # bad values fail before the capture (seconds)
                                     "example_kwargs=, dynamic_shapes=, trace_every_layer=, progress=")
    example_inputs, example_kwargs = _call_inputs(example_inputs, example_kwargs)
    check_request(mesh_spec(mesh), opts.pipeline_axis, opts.microbatches, opts.schedule,
                  _first_batch(example_inputs, example_kwargs), opts.stages_per_device)
    start = time.perf_counter()
    with shown(progress, start=start):
        cap, t_capture, recapture = _capture(model, example_inputs, example_kwargs, opts.precision, dynamic_shapes,
                                             trace_every_layer)
        return _timed(plan_captured(cap, mesh, opts, t_capture=t_capture, recapture=recapture), start)


def _timed(p: Plan, start: float) -> Plan:
    """`p` with the wall seconds since `start` in its stats ("planning_seconds", which print(plan) shows beside
    each stage's): the stages alone leave out the searches whose plan was not taken (other pipelines)."""
    p.stats["planning_seconds"] = time.perf_counter() - start
    return p


def compare(model: torch.nn.Module, example_inputs, mesh, *, example_kwargs: dict | None = None, strategies=None,
            dynamic_shapes=AUTO, trace_every_layer: bool = False, progress: bool | None = None, **options) -> dict:
    """Each strategy's plan for one model and mesh, from one capture: {strategy: the Plan, or the
    AutoparError saying why that strategy does not apply here (a tp degree that does not divide the
    heads, a memory_limit it cannot meet)}. The table engineers draw by hand before a launch.

    `strategies`: "auto" and every named strategy by default. `example_kwargs` and the other options are
    autopar.plan's (hardware, memory_limit, precision, optimizer, progress, ...), the same for every strategy
    (context_weights for those with a context axis, and auto).
    Each plan's planning_seconds (stats, print(plan)) is the capture's and its own search's.
    """
    example_inputs, example_kwargs = _call_inputs(example_inputs, example_kwargs)
    opts = PlanOptions.from_keywords("autopar.compare", options, "example_kwargs=, strategies=, dynamic_shapes=, "
                                                                 "trace_every_layer=, progress=")
    out = {}
    strategies = strategies or STRATEGIES
    problems: dict = {}   # one priced problem for every strategy (planner.plan_captured)
    with shown(progress):
        cap, t_capture, recapture = _capture(model, example_inputs, example_kwargs, opts.precision, dynamic_shapes,
                                             trace_every_layer)
        for i, strategy in enumerate(strategies):
            log.info("strategy %s (%d of %d)", strategy, i + 1, len(strategies))
            start = time.perf_counter() - t_capture
            # context_weights is for the strategies with a context axis: the others are compared without it
            weights = opts.context_weights if strategy in CONTEXT_STRATEGIES + ("auto",) else None
            try:
                asked = replace(opts, strategy=strategy, context_weights=weights)
                out[strategy] = _timed(plan_captured(cap, mesh, asked, t_capture=t_capture, recapture=recapture,
                                                     problems=problems), start)
            except AutoparError as e:
                out[strategy] = e
    return out


def _capture(model, example_inputs: tuple, example_kwargs: dict, precision, dynamic_shapes, trace_every_layer: bool):
    """(the captured model, seconds it took, the recapture a pipelined plan needs)."""
    t0 = time.perf_counter()
    log.info("capturing %s with torch.export", type(model).__name__)
    capture_fn = _at_compute_dtype(capture if trace_every_layer else capture_repeated, model, precision)
    cap = capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
    log.info("captured %d nodes in %.1f s", len(cap.info), time.perf_counter() - t0)
    recapture = _recapture(capture_fn, model, example_inputs, example_kwargs, dynamic_shapes, whole=cap)
    return cap, time.perf_counter() - t0, _for_planning(recapture)


def _call_inputs(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """(positional inputs as a tuple, keyword inputs as a dict), checked before any capture."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if example_kwargs is None:
        return example_inputs, {}
    if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) for k in example_kwargs):
        raise AutoparError(f"example_kwargs must be a dict of keyword name -> input (as the model is called: "
                           f"model(**example_kwargs)), got {type(example_kwargs).__name__}")
    return example_inputs, dict(example_kwargs)


def _at_compute_dtype(capture_fn, model: torch.nn.Module, precision):
    """`capture_fn`, tracing the model at the precision policy's compute dtype (compute_dtype.py)."""
    return at_compute_dtype(capture_fn, model, precision_of(precision).compute)


def _running_capture(model: torch.nn.Module, precision):
    """The whole-model capture parallelize runs, at the policy's compute dtype; one for all the ranks of a
    threaded run (capture/shared.py)."""
    return shared_in_run(_at_compute_dtype(capture, model, precision), label=str(precision_of(precision).compute))


def _first_batch(example_inputs: tuple, example_kwargs: dict):
    """Dim 0 of the first tensor input (positional first), the batch the plan is made for."""
    t = next((v for v in [*example_inputs, *example_kwargs.values()] if isinstance(v, torch.Tensor)), None)
    return t.shape[0] if t is not None and t.dim() > 0 else None


def _microbatch(t, m: int):
    return t[: t.shape[0] // m] if isinstance(t, torch.Tensor) and t.dim() > 0 else t


def microbatch_inputs(example_inputs: tuple, m: int) -> tuple:
    """The first 1/m of the batch (dim 0) of every tensor input: one microbatch, as a pipeline stage runs."""
    return tuple(_microbatch(t, m) for t in example_inputs)


def _recapture(capture_fn, model, example_inputs: tuple, example_kwargs: dict, dynamic_shapes, whole=None):
    """capture at 1/m of the batch, once per m (1: the whole batch, the inputs as given, or `whole` where
    that is captured already): a pipelined plan is made for the graph of one microbatch."""
    done: dict = {} if whole is None else {1: whole}

    def at(m: int) -> Captured:
        if m not in done:
            inputs, kwargs = (example_inputs, example_kwargs) if m == 1 else (
                microbatch_inputs(example_inputs, m), {k: _microbatch(v, m) for k, v in example_kwargs.items()})
            done[m] = capture_fn(model, inputs, dynamic_shapes, kwargs)
        return done[m]
    return at


def _for_planning(recapture):
    """`recapture` for planning only: a microbatch's capture derived from the whole batch's where that is
    exact (capture/microbatch.py: no second torch.export), captured otherwise. What it returns does not
    run: its ExportedProgram is the whole batch's."""
    done: dict = {}

    def at(m: int) -> Captured:
        if m not in done:
            done[m] = (microbatch_of(recapture(1), m) if m > 1 else None) or recapture(m)
        return done[m]
    return at


def parallelize(model: torch.nn.Module, mesh, example_inputs=(), *, example_kwargs: dict | None = None,
                plan: Plan | None = None, dynamic_shapes=AUTO, record_comm: bool = False,
                progress: bool | None = None, **plan_kwargs) -> ParallelModule:
    """Run on every rank: returns this rank's module, holding only its shards.

    `example_inputs` and `example_kwargs` are global (whole-batch) example
    inputs, positional and keyword (as autopar.plan takes them); the returned
    module takes this rank's shard of each, called the same way:
    `pm(*plan.local_inputs(*args), **plan.local_kwargs(**kwargs))`.
    `record_comm=True` logs every collective (model.comm.log) for audits. `progress`: as autopar.plan's,
    shown by rank 0, which plans (the other ranks would only repeat it).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise MeshError("parallelize needs a torch DeviceMesh (e.g. init_device_mesh('cpu', (2, 2), "
                        "mesh_dim_names=('dp', 'tp'))); for planning without devices use autopar.plan")
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialized; run under torchrun and call "
                        "init_device_mesh first")
    opts = PlanOptions.from_keywords("autopar.parallelize", plan_kwargs,   # before the capture, which takes seconds
                                     "example_kwargs=, plan=, dynamic_shapes=, record_comm=, progress=")
    example_inputs, example_kwargs = _call_inputs(example_inputs, example_kwargs)
    spec = mesh_spec(mesh)
    capture_fn = _running_capture(model, plan.precision if plan is not None else opts.precision)
    # the whole batch's capture where a rank needs it: rank 0 to plan, every rank to run a plan that is not
    # pipelined. A pipelined plan runs the graph of one microbatch, a capture of its own (torch.export takes
    # seconds a model): a rank that may get one waits for the plan before it traces, one that will not traces
    # while rank 0 plans
    recapture = _recapture(capture_fn, model, example_inputs, example_kwargs, dynamic_shapes)
    if plan is None:
        start = time.perf_counter()
        with shown(progress if dist.get_rank() == 0 else False, start=start):
            if opts.pipeline_axis is None:
                recapture(1)
            plan = _plan_on_rank0(lambda: recapture(1), mesh, opts, _for_planning(recapture), start)
    cap = recapture(plan.pipeline.microbatches if plan.pipeline is not None else 1)
    _check_plan_matches(plan, cap, spec)
    _check_runtime_precision(plan, cap, mesh_device(mesh))
    grad_nodes = needs_grad(cap)
    plan = _with_schedule(plan, cap, grad_nodes)
    coords = mesh.get_coordinate()
    axes = [AxisGroup(mesh.get_group(name), size, coords[i])
            for i, (name, size) in enumerate(zip(spec.axis_names, spec.axis_sizes))]
    from .runtime.collectives import CommLog
    comm = Comm(axes, CommLog() if record_comm else None,
                random_streams=RandomStreams(agreed_seed(axes, mesh_device(mesh))))
    gm, gathered = rewrite(cap, plan, comm, grad_nodes)
    if plan.pipeline is None:
        other_mode = _other_mode(model, example_inputs, example_kwargs, dynamic_shapes, cap, plan, comm)
    else:   # stages are cut from one graph; say so rather than run the other mode with the wrong one
        other_mode = (OtherMode(refused="a pipelined module runs only the graph of the mode it was parallelized in")
                      if mode_dependent(model, cap.graph) else None)
    pm = ParallelModule(gm, gathered, cap, plan, comm, model, device_mesh=mesh, other_mode=other_mode,
                        grad_nodes=grad_nodes)
    return pm.train(model.training)


def _other_mode(model, example_inputs, example_kwargs, dynamic_shapes, cap: Captured, plan: Plan, comm):
    """The local graph for the mode the model was not captured in (eval for a training model).

    Dropout, random ops and batch norm are traced in the mode the model is in,
    so the other mode needs a graph of its own. The same plan lays it out: its
    nodes are the captured graph's, with other arguments (dropout off), less or
    more ops that change no value (capture/modes.py). None when neither the graph
    nor the model's modules show anything that acts by mode (an eval-mode graph
    of HF attention shows no dropout: it passes dropout_p=0.0 when not training);
    an OtherMode saying why where the other mode cannot run.
    """
    if not mode_dependent(model, cap.graph):
        return None
    was = model.training
    mode = "eval" if was else "train"
    try:
        model.train(not was)
        other = _running_capture(model, plan.precision)(model, example_inputs, dynamic_shapes, example_kwargs)
    except CaptureError as e:
        return OtherMode(refused=f"the model does not capture in {mode} mode: {e}")
    finally:
        model.train(was)
    if not same_ops(cap.graph, other.graph):
        return OtherMode(refused=f"the model's graph in {mode} mode has other ops than in the mode it was "
                                 "parallelized in (forward branches on self.training), so the plan does not apply to it")
    other = without_identities(other)
    try:
        graph, gathered = rewrite(other, _for_graph(plan, other, needs_grad(other)), comm, needs_grad(other))
    except PlanError as e:   # a layout the captured mode's graph allows and the other's does not
        return OtherMode(refused=f"the plan does not run the model's graph in {mode} mode: {e}")
    return OtherMode(graph, gathered)


def _with_schedule(plan: Plan, cap: Captured, grad_nodes: set) -> Plan:
    """`plan` with the schedule its runtime reads (planning/schedule.py): a plan of JSON format 1 has none, so it is
    made here as that autopar made it at run time; one made for other pipeline stages (a plan whose
    `pipeline` was edited) is made again for these, with a warning."""
    if plan.schedule is not None and plan.schedule.stage_cut == stage_cut(plan.pipeline):
        return _with_lowering(plan, cap, grad_nodes)
    if plan.schedule is not None:
        warnings.warn("plan.pipeline's stages are not those its schedule (gradient buckets) was made for; autopar "
                      "makes the schedule again for these stages. Plan again to keep the two together.", stacklevel=3)
    return replace(plan, schedule=schedule_of(cap, plan, grad_nodes))


def _with_lowering(plan: Plan, cap: Captured, grad_nodes: set) -> Plan:
    """`plan` with a lowering.Lowering (what the rewriter does beyond the layouts) for `cap`: a plan of JSON
    format 3 or older has none, and one edited after planning (a layout forced, a weight frozen since) has one
    made for something else (lowering.lowering_key); planning makes it here for this capture, as the runtime
    once derived it."""
    low = plan.schedule.lowering
    if low is not None and low.made_for == lowering_key(cap, plan):
        return plan
    return _for_graph(plan, cap, grad_nodes)


def _for_graph(plan: Plan, cap: Captured, grad_nodes: set) -> Plan:
    """`plan` with its schedule's Lowering made for `cap` (the other mode's graph, whose ops may differ)."""
    return replace(plan, schedule=replace(plan.schedule, lowering=lowering_of(cap, plan, grad_nodes)))


def _plan_on_rank0(whole_batch_capture, mesh, opts: PlanOptions, recapture, start: float) -> Plan:
    """Rank 0 captures the model, plans and broadcasts the plan, so ranks cannot disagree (and plan once,
    not N times); the others capture what the plan they receive runs.

    An error on rank 0, its capture's included, is broadcast too and raised on every rank, so no rank
    waits forever for a plan that will not come.
    """
    import torch.distributed as dist
    message = [None]
    if dist.get_rank() == 0:
        try:
            cap = whole_batch_capture()
            t_capture = time.perf_counter() - start   # the capture is all that ran since `start`
            # threaded ranks share torch's tracing state: a SymInt's arithmetic in the planner would reach the
            # tracer of a rank still capturing, so no rank traces while rank 0 plans (a no-op across processes)
            with trace_lock:
                message[0] = ("plan", _timed(plan_captured(cap, mesh, opts, t_capture=t_capture, recapture=recapture),
                                             start).to_json())
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


def _check_float8(config, device) -> None:
    """What of float8 this runtime and device can run: both recipes, on a CPU (torch emulates the scaled matmul)
    or a GPU with float8 tensor cores (compute capability 8.9: Ada, Hopper and later; the rowwise recipe's
    kernel needs Hopper, 9.0)."""
    if device is None or device.type != "cuda":
        return
    capability, name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    if capability < (8, 9):
        raise PlanError(f"the plan runs linears in float8, and {name} (compute capability "
                        f"{'.'.join(map(str, capability))}) has no float8 tensor cores (8.9 and later: Ada, Hopper, "
                        "Blackwell); plan with precision='bf16-mixed'")
    if config.recipe_name == "rowwise" and capability < (9, 0):
        raise PlanError(f"float8's rowwise recipe runs on Hopper and later (compute capability 9.0), not {name}; "
                        "plan with autopar.Float8(recipe_name='tensorwise')")


def _check_runtime_precision(plan: Plan, cap: Captured, device=None) -> None:
    """The runtime keeps each floating weight once, in the policy's master dtype, with its gradient and
    optimizer state in that dtype too (a torch optimizer keeps state in its parameter's dtype): a policy
    asking for another gradient or optimizer-state dtype cannot run as planned."""
    policy = precision_of(plan.precision)
    if plan.float8_linears:
        _check_float8(policy.float8, device)
    for name, info in cap.info.items():
        if info.kind != PARAM:
            continue
        own = cap.param_dtypes.get(info.target_name, first_meta(info.meta).dtype)
        if not own.is_floating_point:
            continue
        p = policy.resolve(own)
        if p.reduce != p.master and p.compute == p.master:
            raise PlanError(
                f"precision reduce={p.reduce} with compute and master both {p.master} (parameter "
                f"{info.target_name!r}): autopar casts a gradient for its reduction where it casts the weight "
                "for its use, and this policy casts no weight; give compute= a narrower dtype too, or reduce=None")
        for field, dtype in (("grad_accum", p.grad_accum), ("optimizer_state", p.optimizer_state)):
            if dtype != p.master:
                raise PlanError(
                    f"precision {field}={dtype} differs from the master dtype {p.master} (parameter "
                    f"{info.target_name!r}): autopar's runtime keeps gradients and optimizer state in the dtype it "
                    f"stores the weight in; plan with {field}=None (or {p.master})")
