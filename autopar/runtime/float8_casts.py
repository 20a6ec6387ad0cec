"""Float8 casts with dynamic scales, as torchao's float8 training makes them: the parts the float8 linears
(lowering/float8.py) and the FSDP layer groups' float8 all-gathers (reduction/layer_groups.py) share.

A cast multiplies a tensor by a scale, float8's largest value over the tensor's amax (largest magnitude), so
the tensor's range fills float8's; the matmul divides it out again. A rank holds a piece of the tensor, and
its amax is all-reduced with MAX over the mesh axes that split the tensor: every rank then casts with the
scale one device would have used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..sharding.redistribute import ALL_REDUCE
from .collectives import Comm, logged

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12   # torchao's EPS: an all-zero tensor gets a finite scale


def reduce_max(amaxes: torch.Tensor, axes, comm: Comm, phase: str) -> torch.Tensor:
    """`amaxes` (this rank's) with MAX taken over each mesh axis of `axes`, one logged all-reduce per axis."""
    out = amaxes
    for axis in axes:
        out = logged(out, comm, ALL_REDUCE, axis, out.numel() * out.element_size(), phase)
        t0 = comm.start()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=comm.axes[axis].group)
        comm.stop(axis, t0)
    return out


def scale_of(amax_value: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """float8 max / amax, as torchao computes it (in float64, then float32: eager and compiled agree); rounded
    down to a power of 2 where asked (torchao's rowwise recipe: the scale then multiplies exactly)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax_value.to(torch.float64), min=AMAX_FLOOR)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` times `scale`, saturated to `dtype`'s range and cast (torchao's to_fp8_saturated)."""
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)
