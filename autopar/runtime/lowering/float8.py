"""Float8 linears at run time: a captured `aten.linear` the plan runs in float8 (planning/schedule.Lowering.float8).

Forward casts the activation and the weight to float8_e4m3fn and multiplies them with PyTorch's scaled matmul into
the compute dtype; backward casts the output's gradient to float8_e5m2 and makes the input's and the weight's
gradients the same way. These are the casts and matmuls of torchao's Float8Linear (tensorwise recipe), so a
plan on one device computes what torchao computes.

What is ours is the scale. A cast's scale comes from the amax (largest magnitude) of the tensor, and a rank
holds only its piece of it: the activation split over the batch (data parallel), the sequence (context
parallel), the weight over its rows or columns (tensor parallel). Each amax here is all-reduced with MAX over
every mesh axis the tensor is split on, so every rank casts with the scale one device would have used, and the
parallel run equals the one-device float8 run. (torchao under DDP or FSDP scales each rank's batch by its own
amax: its runs differ from one device's.) The amax all-reduces are two bytes each, at most three per linear
and step (plus a recompute's), and they are priced and logged like every other collective.

Backward reuses forward's scales: they are the same tensors' amaxes, so recasting with them is the cast
torchao makes again, without reducing the amaxes again. It keeps the activation and the weight as forward
got them (in the compute dtype, as torchao does), so an FSDP weight is still kept as its shard and gathered
again (regather.py): it is that tensor autograd saves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..._compat import scaled_mm as _scaled_mm
from ...errors import AutoparError
from ...sharding.redistribute import ALL_REDUCE
from ..collectives import Comm, forward_phase, logged

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12   # torchao's EPS: an all-zero tensor gets a finite scale
DIM_MULTIPLE = 16    # the scaled matmul on a GPU: every dim it multiplies over, and the output's columns


def amax(x: torch.Tensor, axes: tuple, comm: Comm, phase: str) -> torch.Tensor:
    """The largest magnitude in the whole tensor of which `x` is this rank's piece, split on mesh `axes`."""
    out = x.abs().max()
    for axis in axes:
        out = logged(out, comm, ALL_REDUCE, axis, out.element_size(), phase)
        t0 = comm.start()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=comm.axes[axis].group)
        comm.stop(axis, t0)
    return out


def scale_of(amax_value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 max / amax, as torchao computes it (in float64, then float32: eager and compiled agree)."""
    return (torch.finfo(dtype).max / torch.clamp(amax_value.to(torch.float64), min=AMAX_FLOOR)).to(torch.float32)


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` times `scale`, saturated to `dtype`'s range and cast (torchao's to_fp8_saturated)."""
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column, as the scaled matmul takes its second operand."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, a_scale, b: torch.Tensor, b_scale, out_dtype, fast_accum: bool) -> torch.Tensor:
    """a @ b of two float8 matrices cast with scales `a_scale`, `b_scale`, in `out_dtype`."""
    return _scaled_mm(a.contiguous(), _column_major(b), a_scale.reciprocal(), b_scale.reciprocal(), out_dtype,
                      fast_accum)


class _Float8Matmul(torch.autograd.Function):
    """x @ w.t() in float8 (x: [..., K] in the compute dtype, w: [N, K]); the scales from whole-tensor amaxes."""

    @staticmethod
    def forward(ctx, x, w, axes: tuple, comm: Comm):
        x_axes, w_axes, ctx.grad_axes = axes
        phase = forward_phase()
        x_scale = scale_of(amax(x, x_axes, comm, phase), E4M3)
        w_scale = scale_of(amax(w, w_axes, comm, phase), E4M3)
        x2 = x.reshape(-1, x.shape[-1])
        _check_rows(x2.shape[0], x.device)
        out = scaled_mm(to_float8(x2, x_scale, E4M3), x_scale, to_float8(w, w_scale, E4M3).t(), w_scale, x.dtype,
                        fast_accum=True)   # torchao's forward default; its backward matmuls accumulate exactly
        ctx.save_for_backward(x, w, x_scale, w_scale)
        ctx.comm = comm
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w, x_scale, w_scale = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        g_scale = scale_of(amax(g2, ctx.grad_axes, ctx.comm, "backward"), E5M2)
        g8 = to_float8(g2, g_scale, E5M2)
        grad_x = scaled_mm(g8, g_scale, to_float8(w, w_scale, E4M3), w_scale, grad.dtype, fast_accum=False)
        x8 = to_float8(x.reshape(-1, x.shape[-1]), x_scale, E4M3)
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale, grad.dtype, fast_accum=False)
        return grad_x.reshape(x.shape), grad_w, None, None


def _check_rows(rows: int, device: torch.device) -> None:
    """The weight gradient's matmul multiplies over the rows (tokens on this rank): a GPU takes multiples of 16."""
    if device.type == "cuda" and rows % DIM_MULTIPLE and not torch.compiler.is_dynamo_compiling():
        raise AutoparError(f"a float8 linear got {rows} rows (batch x sequence on this rank); the scaled matmul on "
                           f"a GPU needs a multiple of {DIM_MULTIPLE}: change the batch or sequence length, or plan "
                           "with precision='bf16-mixed'")


class Float8Linear(torch.nn.Module):
    """One captured linear run in float8 on this rank's pieces. `axes`: (activation's, weight's, output
    gradient's) mesh axes, the ones each is split on, whose amax is reduced over them."""

    def __init__(self, axes: tuple, comm: Comm, label: str):
        super().__init__()
        self.axes, self.comm, self.label = tuple(tuple(a) for a in axes), comm, label

    def forward(self, x, weight, bias=None):
        out = _Float8Matmul.apply(x, weight, self.axes, self.comm)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return self.label
