"""This rank's share of a global batch, as a Plan lays it out (Plan.local_inputs, local_kwargs,
local_targets and data_shard call these).

The one part of a plan that touches torch: it cuts real tensors. Reads only a Plan's fields.
"""
from __future__ import annotations

import torch

from ..errors import PlanError
from ..mesh import MeshSpec
from ..sharding.placement import chunk_index, dim_factor, shard_full_tensor


def local_inputs(plan, global_inputs: tuple, rank: int | None) -> tuple:
    placements = _placements_by_key(plan)
    num_positional = sum(1 for k in placements if isinstance(k, int))
    if len(global_inputs) != num_positional:
        raise PlanError(f"the plan was made for {num_positional} inputs, got {len(global_inputs)}"
                        + ("; its other inputs are keywords: pass them through plan.local_kwargs"
                           if len(placements) > num_positional else ""))
    coords = coordinates(plan, rank)
    return tuple(_local(plan, t, placements[i], coords, f"input {i}") for i, t in enumerate(global_inputs))


def local_kwargs(plan, global_kwargs: dict, rank: int | None) -> dict:
    placements = _placements_by_key(plan)
    coords = coordinates(plan, rank)
    return {k: _local(plan, t, placements[k], coords, f"keyword input {k!r}") if k in placements else t
            for k, t in global_kwargs.items()}


def data_shard(plan, rank: int | None) -> tuple[int, int]:
    placements = plan.input_placements[0] if plan.input_placements else tuple(
        "S(0)" if a in plan.batch_axes else "R" for a in plan.mesh.axis_names)
    coords = coordinates(plan, rank)
    return (chunk_index(placements, 0, coords, plan.mesh.axis_sizes),
            dim_factor(placements, 0, plan.mesh.axis_sizes))


def local_targets(plan, global_targets: tuple, rank: int | None) -> tuple:
    coords = coordinates(plan, rank)
    pl = tuple("S(0)" if a in plan.batch_axes else "R" for a in plan.mesh.axis_names)
    return tuple(shard_full_tensor(t, pl, coords, plan.mesh.axis_sizes).contiguous()
                 if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in global_targets)


def coordinates(plan, rank) -> tuple:
    """`rank`'s coordinates on the plan's mesh: where plan.rank_grid puts it, else row-major.
    `rank`: this process's rank in the default group when None."""
    import torch.distributed as dist
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if plan.rank_grid is not None:
        return _position(plan.rank_grid, rank, plan.mesh)
    coords, r = [], rank
    for n in reversed(plan.mesh.axis_sizes):
        coords.append(r % n)
        r //= n
    return tuple(reversed(coords))


def nested_tuple(grid):
    """DeviceMesh.mesh.tolist() as nested tuples (a Plan is hashable data)."""
    return tuple(nested_tuple(g) for g in grid) if isinstance(grid, (list, tuple)) else int(grid)


def _placements_by_key(plan) -> dict:
    keys = plan.input_keys or range(len(plan.input_placements))
    return dict(zip(keys, plan.input_placements))


def _local(plan, t, placements: tuple, coords: tuple, what: str):
    """This rank's shard of the whole tensor `t` (anything else as it is)."""
    if not (isinstance(t, torch.Tensor) and t.dim() > 0):
        return t
    for d, n in _split_sizes(placements, t, plan.mesh):
        if t.shape[d] % n:
            raise PlanError(f"{what} of shape {tuple(t.shape)}: dim {d} ({t.shape[d]}) does not divide "
                            f"into {n} shards for placements {placements}; use a batch divisible by {n}")
    return shard_full_tensor(t, placements, coords, plan.mesh.axis_sizes).contiguous()


def _split_sizes(pl, t, mesh: MeshSpec):
    for d in range(t.dim()):
        f = dim_factor(pl, d, mesh.axis_sizes)
        if f > 1:
            yield d, f


def _position(rank_grid: tuple, rank: int, mesh: MeshSpec) -> tuple:
    """Where `rank` sits in `rank_grid`: its coordinate on each mesh axis."""
    flat = torch.tensor(rank_grid).reshape(mesh.axis_sizes)
    found = (flat == rank).nonzero()
    if not len(found):
        raise PlanError(f"rank {rank} is not on the mesh this plan runs on (its ranks: {flat.flatten().tolist()}); "
                        "give the rank of a process of that mesh")
    return tuple(int(c) for c in found[0])
