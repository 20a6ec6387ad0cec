"""clip_grad_norm_ for a ParallelModule: torch.nn.utils.clip_grad_norm_ over the whole gradients.

Why torch's own function will not do: on a rank, `p.grad` is this rank's shard of the
gradient (split over FSDP / TP axes, a copy over replicated ones), a pipeline rank holds only
its stages' parameters, and a ZeRO parameter's gradient lives in the optimizer wrapper's flat
slice (`ShardedOptimizer`), not in `p.grad`. Called per rank, torch would clip each rank by a
different, local norm. Here every rank computes the one global norm:

    sum over ranks of the local sum of |g|^p (max of |g| for p = inf), where each replicated
    copy counts once -- only the rank at coordinate 0 of every axis the gradient is
    replicated on contributes; the pipeline axis holds different parameters, so all count --
    all-reduced over every mesh axis in turn (a hybrid mesh needs each), then ^(1/p);

and scales every local gradient (ZeRO slices included) by torch's coefficient,
clamp(max_norm / (norm + 1e-6), max=1). The all-reduces are logged in `pm.comm.log` with
phase "clip" (the plan's predictions do not include them).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...errors import PlanError
from ...sharding.placement import R
from ...sharding.redistribute import ALL_REDUCE
from ..collectives import log_collective


@torch.no_grad()
def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0, optimizer=None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ParallelModule `pm` (any plan) by their global norm; returns that norm.

    The norm is that of all whole gradients concatenated, as `torch.nn.utils.clip_grad_norm_`
    computes it on one device: a float32 0-dim tensor, the same on every rank. A collective:
    call it on every rank, after backward and before `optimizer.step()`. A plan with ZeRO
    parameters (`plan.param_zero`) needs `optimizer=` its `autopar.ShardedOptimizer`: their
    gradients are in its slices (level-1 ones are reduced into them here, once).
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise PlanError(f"clip_grad_norm_ takes a norm_type > 0 or math.inf, got {norm_type}")
    grads = _local_grads(pm, optimizer)
    device = grads[0][0].device if grads else next((p.device for p in pm.parameters()), None)
    total = _global_norm(pm, [g for g, counted in grads if counted], norm_type, device)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)   # torch's formula, unconditionally applied
    for g, _ in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _local_grads(pm, optimizer) -> list:
    """(gradient tensor this rank holds, whether it counts towards the norm), every one once."""
    plan = pm.plan
    zero = []
    if plan.param_zero:
        if optimizer is None or getattr(optimizer, "module", None) is not pm:
            raise PlanError("this plan splits some gradients ZeRO-style (plan.param_zero): they live in the "
                            "optimizer wrapper's slices, not in p.grad; pass the module's wrapper, "
                            "clip_grad_norm_(pm, max_norm, optimizer=opt) with opt = autopar.ShardedOptimizer(pm, ...)")
        optimizer.reduce_gradients()   # level 1: the unreduced p.grad into the slices, so step() does not again
        zero = optimizer.zero_params
    zero_names = {z.name for z in zero}
    out = [(p.grad, _counts(pm, plan.param_placements[name], ()))
           for name, p in pm.named_parameters() if p.grad is not None and name not in zero_names]
    for z in zero:
        if z.slice.grad is not None:   # flat, split over its ZeRO axes, the rest as the parameter's shard
            split = tuple(plan.mesh.axis_index(a) for a in plan.param_zero[z.name][1])
            out.append((z.slice.grad, _counts(pm, plan.param_placements[z.name], split)))
    return out


def _counts(pm, placements, split_axes) -> bool:
    """Whether this rank's copy is the one counted: coordinate 0 on every axis it is replicated on."""
    pipe = pm.plan.mesh.axis_index(pm.plan.pipeline.axis) if pm.plan.pipeline is not None else None
    return all(ax.coord == 0 for a, ax in enumerate(pm.comm.axes)
               if a != pipe and a not in split_axes and placements[a] == R)


def _global_norm(pm, grads, norm_type, device) -> torch.Tensor:
    """The p-norm of the whole gradients: local sums (or maxima) all-reduced over every mesh axis."""
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads if g.numel()]
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    if norms:   # a rank may hold nothing that counts (a copy, or an empty uneven shard)
        norms = torch.stack(norms)
        total = norms.max() if inf else norms.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for a, ax in enumerate(pm.comm.axes):
        if ax.size > 1:
            log_collective(pm.comm, ALL_REDUCE, a, total.numel() * total.element_size(), "clip")
            dist.all_reduce(total, op=op, group=ax.group)
    return total if inf else total.pow(1.0 / norm_type)
