"""Optimizer state that does not depend on the plan: keyed by parameter name, tensors as DTensors.

A torch optimizer's `state_dict()` numbers its parameters and holds this rank's
tensors: a layout-dependent object that cannot resume under another plan or
world size. `ShardedOptimizer.state_dict()` returns instead what
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` returns for
FSDP2 / DTensor models:

    {"state": {fqn: {"step": tensor, "exp_avg": DTensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}

Each parameter-shaped state tensor is a DTensor with its parameter's placements
(the module's `state_dict()` layout), so torch.distributed.checkpoint (DCP)
saves it sharded and loads it into any other plan's layout. A ZeRO slice (flat
1/n of the weight, which no DTensor placement describes) is all-gathered over its
ZeRO axes first, and cut again on load. `load_state` takes this format from any
plan (DTensors of any layout, or whole tensors) and hands the wrapped optimizer
its own, index-keyed format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import PlanError
from ...sharding.placement import R, S, shard_full_tensor
from ..state_dict import same_layout


@dataclass
class PlaceholderState:
    """What init_state made for a ShardedOptimizer (its `placeholder`): whether it ran (or had nothing to
    make), and the state it made, until the first real step drops it."""
    made: bool = False
    state: dict | None = None


def init_state(opt) -> None:
    """Give every parameter its state now, as torch's get_optimizer_state_dict does (optimizers make it
    lazily at their first step): a step on zero gradients at learning rate 0, so nothing moves. Then a
    state_dict made before training has the structure a checkpoint is loaded into.

    That step is no step of training: its step counts are set back to 0 (a checkpoint of it says no
    step was taken), and unless a checkpoint is loaded over it, the first real step drops the state it
    made (`drop_placeholder_state`), so the optimizer starts as it would have on one device (Adam's bias
    correction counts steps; SGD's first step takes the gradient as its momentum buffer)."""
    inner = opt.optimizer
    if inner.state or opt.placeholder.made:
        return   # (SGD without momentum keeps no state: one try is enough)
    if any(p.grad is not None for p in _params(inner)) or any(z.param.grad is not None for z in opt.zero_params):
        return   # between backward and step: the user's gradients are not ours to replace
    opt.placeholder.made = True
    lrs = [g["lr"] for g in inner.param_groups]
    for z in opt.zero_params:
        z.param.grad = None
    for p in _params(inner):
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    try:
        opt.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
    for entry in inner.state.values():
        if isinstance(entry.get("step"), torch.Tensor):
            entry["step"].zero_()
        elif "step" in entry:
            entry["step"] = 0
    opt.placeholder.state = inner.state


def drop_placeholder_state(opt) -> None:
    """Before the first real step: forget the state init_state made, unless a checkpoint replaced it
    (torch's Optimizer.load_state_dict installs a new state dict)."""
    if opt.placeholder.state is not None and opt.optimizer.state is opt.placeholder.state:
        opt.optimizer.state.clear()
    opt.placeholder.state = None


def export_state(opt) -> dict:
    """The wrapped optimizer's state by parameter name, parameter-shaped tensors as DTensors."""
    module = opt.module
    inner = opt.optimizer
    names = opt.param_names
    zero = {id(z.slice): z for z in opt.zero_params}
    state = {}
    for p, fqn in zip(_params(inner), names):
        entry = inner.state.get(p)
        if not entry:
            continue
        state[fqn] = {key: _export(module, opt, fqn, p, zero.get(id(p)), key, value) for key, value in entry.items()}
    groups = []
    ids = {id(p): fqn for p, fqn in zip(_params(inner), names)}
    for g in inner.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [ids[id(p)] for p in g["params"]]})
    if len(groups) == 1 and module.plan.pipeline is not None:
        # DCP keeps one rank's copy of what is not a tensor: the one group names the whole model's parameters,
        # not this stage's, so a plan that holds others can load it
        groups[0]["params"] = [n for n in module.global_shapes if n not in module.aliases]
    return {"state": state, "param_groups": groups}


def load_state(opt, state_dict: dict) -> None:
    """Load `export_state`'s format, made under any plan, into this wrapper's optimizer."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise PlanError("ShardedOptimizer.load_state_dict takes what ShardedOptimizer.state_dict() returns: "
                        "{'state': {parameter name: {...}}, 'param_groups': [...]}")
    inner = opt.optimizer
    names = opt.param_names
    index = {fqn: i for i, fqn in enumerate(names)}
    unknown = sorted(set(state_dict["state"]) - set(index))
    if unknown:
        raise PlanError(f"optimizer state for parameters this module does not have: {unknown[:5]}"
                        f"{' ...' if len(unknown) > 5 else ''}")
    params = list(_params(inner))
    zero = {id(z.slice): z for z in opt.zero_params}
    state = {}
    for fqn, entry in state_dict["state"].items():
        i = index[fqn]
        state[i] = {key: _import(opt, fqn, params[i], zero.get(id(params[i])), key, value)
                    for key, value in entry.items()}
    if len(state_dict["param_groups"]) != len(inner.param_groups):
        raise PlanError(f"the checkpoint has {len(state_dict['param_groups'])} parameter groups, this optimizer "
                        f"{len(inner.param_groups)}")
    # each group: the checkpoint's hyperparameters, this optimizer's parameters (a pipeline stage holds some
    # of the group's; DCP hands every rank the group as one rank saved it)
    groups, start = [], 0
    for saved, own in zip(state_dict["param_groups"], inner.param_groups):
        mine = list(range(start, start + len(own["params"])))
        start += len(own["params"])
        absent = [names[i] for i in mine if names[i] not in saved["params"]]
        if absent:
            raise PlanError(f"the checkpoint's parameter groups do not hold {absent[:3]}: it was saved for another "
                            "model or optimizer")
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": mine})
    inner.load_state_dict({"state": state, "param_groups": groups})


def _params(inner):
    return [p for g in inner.param_groups for p in g["params"]]


def _shaped(value, p: torch.Tensor) -> bool:
    """A state tensor that follows its parameter element by element (Adam's moments, momentum buffers)."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0


def _export(module, opt, fqn: str, p, z, key: str, value):
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value.clone() if isinstance(value, torch.Tensor) else value   # "step" and other scalars
    if not _shaped(value, p):
        raise PlanError(f"optimizer state {key!r} of {fqn!r} has shape {tuple(value.shape)}, not its parameter's "
                        f"{tuple(p.shape)}: autopar cannot lay it out for another plan")
    local = value.detach()
    if z is not None:   # a ZeRO slice: gather the rank's whole local tensor first
        local = opt.gather(z, local, "checkpoint").view_as(z.param)
    return module.export_tensor(local, module.plan.param_placements[fqn], False, module.global_shapes[fqn])


def _import(opt, fqn: str, p, z, key: str, value):
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value.clone() if isinstance(value, torch.Tensor) else value
    module = opt.module
    plan = module.plan
    sizes, coords = plan.mesh.axis_sizes, module.coords
    if tuple(value.shape) != tuple(module.global_shapes[fqn]):
        raise PlanError(f"optimizer state {key!r} of {fqn!r} has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(module.global_shapes[fqn])}")
    if same_layout(value, *module.stored_layout(plan.param_placements[fqn])):
        local = value.to_local().to(p.dtype)   # this rank's piece already (DCP loaded it in place)
    else:
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        local = shard_full_tensor(value.to(p.dtype), plan.param_placements[fqn], coords, sizes)
    if z is not None:   # this plan steps a flat slice of it
        axes = [plan.mesh.axis_names.index(a) for a in plan.param_zero[fqn][1]]
        sliced = tuple(S(0) if a in axes else R for a in range(len(sizes)))
        local = shard_full_tensor(local.reshape(-1), sliced, coords, sizes)
    return local.clone().to(p.device)
