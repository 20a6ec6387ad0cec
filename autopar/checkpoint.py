"""autopar.checkpoint: save a run (model, optimizer, step) and resume it under any plan.

    autopar.checkpoint.save("ckpt/step100", pm, opt, step=100)          # every rank
    ...
    pm = autopar.parallelize(model, other_mesh, inputs, ...)             # another plan, another world size
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=...)
    step = autopar.checkpoint.load("ckpt/step100", pm, opt)

Both wrap torch.distributed.checkpoint (DCP): the module's `state_dict()` and the
ShardedOptimizer's are DTensors keyed by the original parameter names, so DCP writes
each rank's pieces once and reads into whatever layout the loading plan has. A
checkpoint written this way is a plain DCP checkpoint: torch's own tools read it.
"""
from __future__ import annotations

import torch.distributed.checkpoint as dcp

from .errors import PlanError


def save(path, module, optimizer=None, *, step: int | None = None) -> None:
    """Write the module's parameters and buffers (and the optimizer's state, and `step`) to `path`."""
    dcp.save(_state(module, optimizer, step), checkpoint_id=path)


def load(path, module, optimizer=None) -> int | None:
    """Read `path` into the module (and the optimizer) as this plan lays them out; returns the saved step."""
    state = _state(module, optimizer, 0)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:   # DCP's CheckpointException wraps each rank's error: name the file and the cause
        raise PlanError(f"autopar.checkpoint.load({str(path)!r}): {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from e
    module.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    return state.get("step")


def _state(module, optimizer, step) -> dict:
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
