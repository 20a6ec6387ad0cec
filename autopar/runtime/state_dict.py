"""A ParallelModule's state as DTensors (or whole tensors), and loading one made under any plan.

`state_dict()` gives each stored tensor as a DTensor on the device mesh with the plan's placements
(a pipelined module: on the mesh without the pipeline axis, its stages' tensors only), so
torch.distributed.checkpoint saves each rank's pieces once; `load_state_dict` takes DTensors of any
layout or whole tensors and keeps this module's layout: a tensor already laid out as here is copied
from its local piece, anything else made whole and cut.
"""
from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from ..errors import PlanError
from ..sharding.placement import R, gathered_size, is_shard, shard_dim, shard_full_tensor
from .collectives import transform

LoadResult = namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])


def export_tensor(pm, local, placements, full, shape):
    """This rank's `local` piece of a tensor of whole `shape`: gathered whole, or as a DTensor."""
    if full:
        x = local
        current = tuple(placements)
        for a in reversed(range(len(placements))):
            if is_shard(placements[a]):
                whole = gathered_size(shape, current, a, pm.plan.mesh.axis_sizes)
                x = transform(x, placements[a], R, a, pm.comm, "checkpoint", whole)
                current = current[:a] + (R,) + current[a + 1:]
        return x
    if pm.device_mesh is None:
        raise PlanError("state_dict() as DTensors needs the DeviceMesh given to parallelize; "
                        "use state_dict(full=True) for whole tensors")
    from torch.distributed.tensor import DTensor
    mesh, placements = stored_layout(pm, placements)
    if mesh is None:   # a pipeline over the only axis: the stage's tensor is whole
        return local
    # shape and stride given: a split that does not divide leaves ranks' pieces of unequal length,
    # which DTensor lays out as torch.chunk does, as placement.py does
    return DTensor.from_local(local, mesh, dtensor_placements(placements), run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def stored_layout(pm, placements) -> tuple:
    """(DeviceMesh, placements) a stored tensor is given as: the whole mesh, or for a pipelined module
    the mesh without the pipeline axis (a stage's tensor is whole along it and held by one of its
    ranks), None when no axis is left."""
    pipe = pm.plan.pipeline
    if pipe is None:
        return pm.device_mesh, tuple(placements)
    names = pm.plan.mesh.axis_names
    keep = [i for i, n in enumerate(names) if n != pipe.axis]
    if not keep:
        return None, ()
    return pm.device_mesh[tuple(names[i] for i in keep)], tuple(placements[i] for i in keep)


def load_module_state(pm, state_dict, strict: bool = True):
    """Accepts DTensors or whole tensors, in any layout; keeps this module's layout."""
    own = dict(pm.store.named_parameters())
    own.update(dict(pm.store.named_buffers()))
    own.update({a: own[c] for a, c in pm.aliases.items() if c in own})
    missing = [k for k in own if k not in state_dict]
    # a pipelined module holds its stages' tensors: the model's others are expected, and skipped
    known = set(own) if pm.plan.pipeline is None else set(own) | pm.model_names
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise PlanError(f"state_dict does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for fqn, value in state_dict.items():
            if fqn not in own:
                continue
            placements = pm.plan.param_placements.get(pm.aliases.get(fqn, fqn),
                                                         (R,) * pm.plan.mesh.num_axes)
            if same_layout(value, *stored_layout(pm, placements)):
                own[fqn].copy_(value.to_local())   # this rank's piece already: nothing whole is made
                continue
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            own[fqn].copy_(shard_full_tensor(value, placements, pm.coords, pm.plan.mesh.axis_sizes))
    return LoadResult(missing, unexpected)


def dtensor_placements(placements) -> list:
    """autopar's placements ("S(d)" / "R" per axis) as DTensor's."""
    from torch.distributed.tensor import Replicate, Shard
    return [Shard(shard_dim(p)) if is_shard(p) else Replicate() for p in placements]


def same_layout(value, mesh, placements) -> bool:
    """Is `value` a DTensor laid out over `mesh` as `placements` say (so its local piece is ours)?"""
    if mesh is None or not hasattr(value, "placements") or value.device_mesh != mesh:
        return False
    return list(value.placements) == dtensor_placements(placements)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def own_state(pm, full: bool, keep_vars: bool) -> OrderedDict:
    """A ParallelModule's entries by original name: DTensors, or whole tensors with `full`; tied weights under
    every name, as torch lists them."""
    def local(t):
        return t if keep_vars else t.detach()
    out = OrderedDict()
    for fqn, p in pm.store.named_parameters():
        out[fqn] = export_tensor(pm, local(p), pm.plan.param_placements[fqn], full, pm.global_shapes[fqn])
    for fqn, b in pm.store.named_buffers():
        out[fqn] = export_tensor(pm, local(b), (R,) * pm.plan.mesh.num_axes, full, tuple(b.shape))
    for alias, canonical in pm.aliases.items():
        if canonical in out:
            out[alias] = out[canonical]
    return out


def full_grads(pm) -> dict:
    """Whole gradients by original parameter name, copied (ParallelModule.full_grads)."""
    return {fqn: export_tensor(pm, p.grad.detach().clone(), pm.plan.param_placements[fqn], True, pm.global_shapes[fqn])
            for fqn, p in pm.store.named_parameters() if p.grad is not None}


def load_under_prefix(pm, state_dict, prefix, local_metadata, missing_keys, unexpected_keys, error_msgs) -> None:
    """A parent module's load_state_dict (or torch.compile's wrapper's) reaching a ParallelModule: its entries
    are those under `prefix`; what is missing or unexpected is reported to the parent, which decides."""
    if local_metadata.get("assign_to_params_buffers"):
        error_msgs.append(f"{prefix}: load_state_dict(assign=True) cannot replace a ParallelModule's shards "
                          "with whole tensors; load without assign (the values are copied into the shards)")
        return
    own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    result = load_module_state(pm, own, strict=False)
    missing_keys.extend(prefix + k for k in result.missing_keys)
    unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
