"""Save a run (model, optimizer, step) and resume it under any plan.

    autopar.checkpoint.save("ckpt/step100", pm, opt, step=100)          # every rank
    ...
    pm = autopar.parallelize(model, other_mesh, inputs, ...)             # another plan, another world size
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=...)
    step = autopar.checkpoint.load("ckpt/step100", pm, opt)

Both wrap torch.distributed.checkpoint (DCP): the module's `state_dict()` and the
ShardedOptimizer's are DTensors keyed by the original parameter names, so DCP writes
each rank's pieces once and reads into whatever layout the loading plan has. A
checkpoint written this way is a plain DCP checkpoint: torch's own tools read it, and
`load` reads theirs (a single device's `dcp.save(model.state_dict(), ...)` included),
holding at most one whole tensor of it at a time (streaming.one_tensor_at_a_time_reader).
"""
from __future__ import annotations

from ..errors import PlanError
from .streaming import one_tensor_at_a_time_reader


def save(path, module, optimizer=None, *, step: int | None = None) -> None:
    """Write the module's parameters and buffers (and the optimizer's state, and `step`) to `path`; every rank."""
    import torch.distributed.checkpoint as dcp   # imported here, not at import time: streaming.py says why

    dcp.save(run_state(module, optimizer, step), checkpoint_id=path)


def load(path, module, optimizer=None, *, strict: bool = True) -> int | None:
    """Read `path` into the module (and the optimizer) as this plan lays them out; every rank, after
    `pm.to_empty(device=...)` for a module built on meta. Returns the saved step (None if none was saved).

    `strict`: as in `load_state_dict`, a tensor the checkpoint lacks raises (its shard would hold garbage);
    with False it is left as it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    reader = one_tensor_at_a_time_reader(path)
    try:
        stored = set(reader.read_metadata().state_dict_metadata)
    except Exception as e:
        raise PlanError(f"autopar.checkpoint.load({str(path)!r}): no DCP checkpoint there ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from e
    state = run_state(module, optimizer, 0 if "step" in stored else None)
    model_alone = not any(f"model.{k}" in stored for k in state["model"])
    if model_alone:
        # the model's state_dict saved alone (a single device's dcp.save(model.state_dict(), ...)): its names
        # at the top level, no optimizer state, no step
        if optimizer is not None:
            raise PlanError(f"autopar.checkpoint.load({str(path)!r}): the checkpoint holds a model's state_dict alone "
                            "(as dcp.save(model.state_dict(), ...) writes it), no optimizer state; load it without "
                            "the optimizer, or save with autopar.checkpoint.save(path, pm, opt)")
        state = state["model"]
    try:
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    except Exception as e:   # DCP's CheckpointException wraps each rank's error: name the file and the cause
        raise PlanError(f"autopar.checkpoint.load({str(path)!r}): {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if model_alone:
        module.load_state_dict(state, strict=strict)
        return None
    module.load_state_dict(state["model"], strict=strict)
    if optimizer is not None and "optim" in state:
        optimizer.load_state_dict(state["optim"])
    return state.get("step")


def run_state(module, optimizer, step) -> dict:
    """What save writes and load fills: {"model": ..., "optim": ..., "step": ...}."""
    state = {"model": module.state_dict()}
    if optimizer is not None:
        if not hasattr(optimizer, "param_names"):
            raise PlanError("autopar.checkpoint takes an autopar.ShardedOptimizer (its state is keyed by parameter "
                            f"name, so any plan can load it), got {type(optimizer).__name__}; wrap it: "
                            "autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=...)")
        state["optim"] = optimizer.state_dict()
    if step is not None:
        state["step"] = step
    return state
