"""Check a parallel module against the single-device one.

single_device_reference records the numbers a parallel run must reproduce;
parallel_record, run on every rank (by run_threaded or run_gloo), records
what the parallel module did, for a test to compare.

run_gloo runs N real processes talking gloo over localhost TCP; nothing is simulated,
for end-to-end checks. The processes are forked from a server process that has
imported torch and autopar once (multiprocessing's forkserver), so a launch costs
a fraction of a second, not each rank's seconds of imports.
"""

import faulthandler
import importlib.util
import multiprocessing
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn import functional as F

from .._compat import exit_without_teardown
from .threaded import RankError

__all__ = ["run_gloo", "gpt_loss", "single_device_reference", "parallel_record", "parallel_records",
           "audit_rows", "audit_each"]


# -----------------------------------------------------------------------------
# real multi-process gloo

def free_port() -> int:
    # The port is free now; rank 0 binds it a moment later. A race with another
    # program is possible but rare, and shows as an init error, not a hang.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world_size, port, result_dir, fn, args, environ=None):
    """One rank's process: join gloo, run fn, leave its result (rank<r>.pt) or its traceback (rank<r>.err).
    `environ`: the launching process's environment at launch (a forked rank starts with the fork server's)."""
    faulthandler.enable()   # a crash in torch's C++ (SIGABRT, SIGSEGV) prints every thread's Python stack
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, *args)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    except BaseException:
        # A failing rank makes its peers fail too (connection closed), and
        # the parent may hear of a peer first; the time tells it the cause.
        # Written before destroy_process_group, i.e. before peers can notice.
        # written whole under another name, then renamed: the parent may list the folder while a
        # peer is still writing, and must never read half a file
        path = os.path.join(result_dir, f"rank{rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)
        raise
    finally:
        dist.destroy_process_group()
    # written only on success: a missing file means the rank failed
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    exit_without_teardown()   # done: torch's teardown at exit sometimes aborts a finished rank (_compat.py)


def _first_failure(result_dir, rank, msg):
    """(rank, traceback) of the rank that failed first by its .err file's time; (rank, msg) if none wrote one."""
    failures = []
    for name in os.listdir(result_dir):
        if name.endswith(".err"):
            with open(os.path.join(result_dir, name)) as f:
                when, _, tb = f.read().partition("\n")
            failures.append((float(when), int(name[4:-4]), tb))
    return min(failures)[1:] if failures else (rank, msg)


def run_gloo(world_size: int, fn, *args, timeout: float = 300) -> list:
    """Run fn(rank, *args) in world_size processes joined by a gloo process group.

    fn must be a module-level function (the processes are new ones, so fn and
    args are pickled). Returns fn's return values in rank order (saved with
    torch.save, so tensors, dicts and numbers all travel). If a rank raises,
    the others are killed and RankError carries that rank's traceback. If the
    run exceeds timeout seconds, all processes are killed and TimeoutError raised.
    """
    with tempfile.TemporaryDirectory(prefix="autopar_gloo_") as result_dir:
        ctx = _start_ranks(world_size, result_dir, fn, args)
        _wait_for_ranks(ctx, result_dir, world_size, timeout)
        return _load_results(result_dir, world_size)


# what the fork server imports once, so that ranks forked from it start with them: the ranks' own
# imports were most of a launch (4.6 s for 4 ranks on 2 cores, 0.13 s forked)
PRELOAD = ("torch", "torch.distributed", "autopar", "autopar.testing", "transformers")


def _start_method() -> str:
    """forkserver where the platform has it, else spawn. Never plain fork: the launching process may
    run threads (threaded ranks, gloo's), and a fork copies their locks mid-use."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = multiprocessing.get_context("forkserver")
    # read when the server starts (the first launch): modules not installed are left out
    ctx.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
    return "forkserver"


def _start_ranks(world_size: int, result_dir: str, fn, args: tuple):
    """Start the rank processes (not waiting for them), each single-threaded; returns their context
    (torch.multiprocessing.start_processes')."""
    # Processes read OMP_NUM_THREADS when they import torch, before any of our code runs in them, so it
    # must be in the environment of the fork server (started by the first launch) and of spawned ranks.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        environ = dict(os.environ)   # a forked rank gets the server's environment; it takes this one instead
        return mp.start_processes(
            _gloo_worker, args=(world_size, free_port(), result_dir, fn, args, environ),
            nprocs=world_size, join=False, start_method=_start_method())
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _wait_for_ranks(ctx, result_dir: str, world_size: int, timeout: float) -> None:
    """Join every rank; RankError for the first that failed, TimeoutError past `timeout`; no process outlives it."""
    try:
        deadline = time.monotonic() + timeout
        # join returns False while any process runs, raises if one failed
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run_gloo: {world_size} ranks did not finish "
                                   f"within {timeout} s (deadlock in a collective?)")
    except mp.ProcessRaisedException as e:
        rank, tb = _first_failure(result_dir, e.error_index, e.msg)
        raise RankError(rank, f"rank {rank} of {world_size} raised:\n{tb}") from e
    except mp.ProcessExitedException as e:
        raise RankError(e.error_index, f"rank {e.error_index} of {world_size} "
                                       f"exited: {e.msg}") from e
    finally:
        # after a timeout, a failure or Ctrl-C in the parent: no orphans
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


def _load_results(result_dir: str, world_size: int) -> list:
    """The return values the ranks saved, in rank order."""
    results = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False))
    return results


def gpt_loss(logits, targets):
    """Mean cross-entropy over all B*T positions."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# -----------------------------------------------------------------------------
# the reference a parallel run is compared with

def single_device_reference(model_fn, inputs, targets, loss_fn, steps=3, lr=1e-2, optimizer=None) -> dict:
    """Train model_fn() on one device and record what a parallel run must reproduce.

    model_fn returns a freshly seeded model (call it again for the parallel
    run and both start from the same weights). inputs is one tensor or a tuple
    of them (passed as model(*inputs)). Every step uses the same full batch:
    loss = loss_fn(model(*inputs), targets); loss.backward(); optimizer(lr).step()
    (`optimizer`: a torch.optim class, AdamW by default; SGD shows a wrong gradient scale, Adam hides it).

    Returns a dict:
      outputs: model output of step 1 (before any update), detached
      grads:   {param name: grad of step 1}, cloned (params without a grad left out)
      params:  {param name: value after all `steps` optimizer steps}, cloned
      losses:  [loss of step 1, ..., loss of step `steps`] as floats
    """
    model = model_fn()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    opt = (optimizer or torch.optim.AdamW)(model.parameters(), lr=lr)
    record = {"outputs": None, "grads": {}, "params": {}, "losses": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(*inputs)
        loss = loss_fn(out, targets)
        loss.backward()
        if step == 0:
            record["outputs"] = out.detach().clone()
            record["grads"] = {n: p.grad.detach().clone()
                               for n, p in model.named_parameters() if p.grad is not None}
        record["losses"].append(loss.item())
        opt.step()
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def parallel_record(rank: int, model: nn.Module, mesh_shape: tuple, axis_names: tuple, inputs, targets,
                    loss_fn, steps: int = 3, lr: float = 1e-2, plan_kwargs: dict | None = None,
                    optimizer=None, device: str = "cpu") -> dict:
    """The parallel counterpart of single_device_reference, run on one rank.

    `model` is the same freshly seeded single-device model (a copy is taken, and moved to `device`:
    "cuda" runs every rank on this process's current GPU), inputs/targets are the global batch.
    Records this rank's outputs of step 1, the whole gradients of step 1, the whole parameters after
    all steps, the local losses, the plan and the collectives logged during step 1.
    """
    runs = {"run": (optimizer or torch.optim.AdamW, lr)}
    return parallel_records(rank, model, mesh_shape, axis_names, inputs, targets, loss_fn, runs, steps,
                            plan_kwargs, device)["run"]


def parallel_records(rank: int, model: nn.Module, mesh_shape: tuple, axis_names: tuple, inputs, targets,
                     loss_fn, runs: dict, steps: int = 3, plan_kwargs: dict | None = None,
                     device: str = "cpu") -> dict:
    """parallel_record once per entry of `runs` ({name: (optimizer class, lr)}), each from the same start:
    one parallelize serves every run (its capture and plan are what take the time), its starting weights
    loaded back between runs. Returns {name: parallel_record's record}."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    model = copy.deepcopy(model).to(device)
    inputs = tuple(x.to(device) for x in (inputs if isinstance(inputs, tuple) else (inputs,)))
    targets = targets.to(device)
    mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=axis_names)
    pm = autopar.parallelize(model, mesh, inputs, record_comm=True, **(plan_kwargs or {}))
    local_in = pm.plan.local_inputs(*inputs)
    (local_targets,) = pm.plan.local_targets(targets)
    start = {k: v.clone() for k, v in pm.state_dict(full=True).items()} if len(runs) > 1 else None
    out = {}
    for name, (optimizer, lr) in runs.items():
        if start is not None:
            pm.load_state_dict(start)
        # the wrapper steps ZeRO parameters on their slices; other parameters it passes through
        opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
        out[name] = _record_steps(pm, opt, local_in, local_targets, loss_fn, steps)
    return out


def _record_steps(pm, opt, local_in, local_targets, loss_fn, steps: int) -> dict:
    """Train `pm` for `steps` steps; parallel_record's record of them."""
    record = {"outputs": None, "grads": {}, "params": {}, "losses": [], "plan": pm.plan, "comm": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if step == 0:
            pm.comm.log.records.clear()
        out = pm(*local_in)
        loss = loss_fn(out, local_targets)
        loss.backward()
        if step == 0:
            record["outputs"] = out.detach().clone()
            record["grads"] = opt.full_grads()
        record["losses"].append(loss.item())
        opt.step()
        if step == 0:
            # after step(): ZeRO's collectives run there; full_grads()'s own are not the step's
            record["comm"] = [r for r in pm.comm.log.records if r[3] != "checkpoint"]
    record["params"] = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    return record


def audit_rows(rank: int, model: nn.Module, x, mesh_shape: tuple, axis_names: tuple, plan_kwargs: dict) -> tuple:
    """On one rank: parallelize a copy of `model` (hardware "cpu", `plan_kwargs`) and autopar.audit one AdamW
    step on `x`. Returns ({quantity: (predicted, measured)} of the audit's rows, the plan)."""
    import copy
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", **plan_kwargs)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    return {r.quantity: (r.predicted, r.measured) for r in report.rows}, pm.plan


def audit_each(rank: int, model: nn.Module, x, mesh_shape: tuple, axis_names: tuple, requests: list) -> list:
    """audit_rows once per entry of `requests` (plan_kwargs each), in one run: its ranks trace the model once
    for them all (capture/shared.py), where a run per request traces it again each time."""
    return [audit_rows(rank, model, x, mesh_shape, axis_names, kwargs) for kwargs in requests]


# -----------------------------------------------------------------------------
# a model called with keywords, its loss inside forward (Hugging Face's `labels=`)

def check_records_against_one_device(records: list, ref: dict, atol: float = 1e-5) -> None:
    """Assert each rank's parallel_record equals the one-device run single_device_reference recorded: its
    outputs (its shard of them), its gradients and its parameters after the steps to `atol`, and the bytes its
    collectives moved on each mesh axis to the plan's prediction."""
    import math

    import cost_models as cm
    for rank, rec in enumerate(records):
        plan = rec["plan"]
        (want,) = plan.local_targets(ref["outputs"], rank=rank)
        torch.testing.assert_close(rec["outputs"], want, atol=atol, rtol=0, msg=lambda m: f"rank {rank} outputs: {m}")
        assert set(rec["grads"]) == set(ref["grads"]), (rank, set(rec["grads"]) ^ set(ref["grads"]))
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rec["grads"][name], g, atol=atol, rtol=0,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=atol, rtol=0, msg=lambda m: f"rank {rank} {name}: {m}")
        measured = {a: 0.0 for a in plan.mesh.axis_names}
        for kind, axis, nbytes, _ in rec["comm"]:
            measured[plan.mesh.axis_names[axis]] += cm.bytes_moved(kind, nbytes, plan.mesh.axis_sizes[axis])
        unsent = _swaps_not_sent(plan, rank)
        for a, moved in measured.items():
            predicted = plan.predicted.comm_bytes.get(a, 0.0) - unsent.get(a, 0.0)
            assert math.isclose(moved, predicted, rel_tol=1e-12, abs_tol=1e-9), (
                f"rank {rank} axis {a}: the plan predicted {predicted} bytes, the collectives moved {moved}")


def check_runs_against_one_device(model: nn.Module, inputs, targets, loss_fn, records: list, runs: dict,
                                  steps: int = 3, atol: float = 1e-5) -> None:
    """check_records_against_one_device for each run of parallel_records' `records` (one per rank), against
    single_device_reference trained with that run's optimizer and lr (`runs`: {name: (optimizer class, lr)})."""
    import copy
    for name, (optimizer, lr) in runs.items():
        ref = single_device_reference(lambda: copy.deepcopy(model), inputs, targets, loss_fn, steps=steps, lr=lr,
                                      optimizer=optimizer)
        try:
            check_records_against_one_device([r[name] for r in records], ref, atol)
        except AssertionError as e:   # which optimizer's run differed
            raise AssertionError(f"{name}: {e}") from e


def _swaps_not_sent(plan, rank: int) -> dict:
    """Per axis name, the bytes of ring attention's row swaps this rank does not send: the plan prices the
    other ranks' (cost/terms.ring_collectives), and the middle rank of an odd axis swaps none."""
    import cost_models as cm
    from autopar.cost.terms import SWAPPED_ROWS, skips_swaps
    from autopar.planning.inputs import coordinates
    coords = coordinates(plan, rank)
    out: dict = {}
    for c in plan.collectives:
        a = plan.mesh.axis_names.index(c.axis)
        if c.tensor.endswith(SWAPPED_ROWS) and skips_swaps(plan.mesh.axis_sizes[a], coords[a]):
            out[c.axis] = out.get(c.axis, 0.0) + cm.bytes_moved(c.kind, c.bytes, plan.mesh.axis_sizes[a])
    return out


def keyword_reference(model: nn.Module, batch: dict, optimizer, lr: float, steps: int = 3) -> dict:
    """One device trains `model` (a copy) as a Hugging Face script does: `out = model(**batch)`,
    `out.loss.backward()`, `opt.step()`. Records each step's loss and the parameters after the steps."""
    import copy
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def keyword_parallel_record(rank: int, model: nn.Module, mesh_shape: tuple, batch: dict, strategy: str,
                            runs: dict, steps: int = 3, compile_backend: str | None = None,
                            plan_kwargs: dict | None = None) -> dict:
    """keyword_reference's parallel counterpart on one rank, once per entry of `runs` ({name: (optimizer
    class, lr)}), each from the same start: `pm(**plan.local_kwargs(**batch))`, or the module compiled with
    `compile_backend` (torch.compile). One parallelize serves every run (its capture is what takes the
    time): the starting weights are loaded back between runs.
    Records {name: {"losses", "params"}} and what the module's outputs held (`past_key_values`, the local
    logits' shape)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[:len(mesh_shape)])
    pm = autopar.parallelize(copy.deepcopy(model), mesh, example_kwargs=batch, strategy=strategy,
                             **(plan_kwargs or {}))
    local = pm.plan.local_kwargs(**batch)
    run = pm if compile_backend is None else torch.compile(pm, backend=compile_backend)
    start = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    record = {"plan": pm.plan}
    for name, (optimizer, lr) in runs.items():
        pm.load_state_dict(start)
        opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out = run(**local)
            out.loss.backward()
            opt.step()
            losses.append(out.loss.item())
        record[name] = {"losses": losses, "params": {k: v.clone() for k, v in pm.state_dict(full=True).items()}}
    record["past_key_values"] = out.past_key_values
    record["logits_shape"] = tuple(out.logits.shape)
    return record


def check_keyword_training(model: nn.Module, batch: dict, strategy: str, runs: dict, atol: dict,
                           mesh_shape: tuple = (2, 2), references: dict | None = None,
                           compile_backend: str | None = None, plan_kwargs: dict | None = None) -> list:
    """Train `model` with keywords under `strategy` on threaded ranks (compiled with `compile_backend`, if
    given; `plan_kwargs` for parallelize), once per entry of `runs` ({name: (optimizer class, lr)}), and
    assert every rank's losses and parameters after the steps equal one device's (keyword_reference, or
    `references` by run name) to `atol[name]`. Returns the ranks' records."""
    from .threaded import run_threaded
    refs = references or {name: keyword_reference(model, batch, opt, lr) for name, (opt, lr) in runs.items()}
    world = 1
    for n in mesh_shape:
        world *= n
    records = run_threaded(world, keyword_parallel_record, model, mesh_shape, batch, strategy, runs, 3,
                           compile_backend, plan_kwargs, timeout=300)
    for rank, rec in enumerate(records):
        for name, ref in refs.items():
            where = f"{type(model).__name__} {strategy} {name} rank {rank}"
            torch.testing.assert_close(torch.tensor(rec[name]["losses"]), torch.tensor(ref["losses"]),
                                       atol=atol[name], rtol=0, msg=lambda m: f"{where} losses: {m}")
            for fqn, value in ref["params"].items():
                torch.testing.assert_close(rec[name]["params"][fqn], value, atol=atol[name], rtol=0,
                                           msg=lambda m: f"{where} {fqn}: {m}")
    return records
