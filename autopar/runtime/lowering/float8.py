"""Float8 linears at run time: a captured `aten.linear` the plan runs in float8 (planning/lowering.Lowering.float8).

Forward casts the activation and the weight to float8 and multiplies them with PyTorch's scaled matmul into
the compute dtype; backward casts the output's gradient and makes the input's and the weight's gradients the
same way. These are the casts and matmuls of torchao's Float8Linear, by its tensorwise recipe (e4m3 forward,
e5m2 gradient, one scale per tensor) or its rowwise one (every cast e4m3, a scale per row or column, rounded
down to a power of 2), so a plan on one device computes what torchao computes.

What is ours is the scale. A cast's scale comes from the amax (largest magnitude) of the tensor, or of its row,
and a rank holds only its piece of it: the activation split over the batch (data parallel), the sequence
(context parallel), the weight over its rows or columns (tensor parallel). Each amax here is all-reduced with
MAX over every mesh axis that splits what it runs along, so every rank casts with the scale one device would
have used, and the parallel run equals the one-device float8 run. (torchao under DDP or FSDP scales each
rank's batch by its own amax: its runs differ from one device's.) Tensorwise all-reduces at most three
2-byte amaxes per linear and step (plus a recompute's), rowwise up to six rows or columns of them; they are
priced and logged like every other collective.

Under enable_fsdp_float8_all_gather, a tensorwise linear whose weight its FSDP layer group gathers takes the
weight's local shard instead, and the group casts it before the gather (reduction/layer_groups.py): the weight's
amax is then the group's to reduce (_TensorwiseGathered).

Tensorwise backward reuses forward's scales: they are the same tensors' amaxes, so recasting with them is the
cast torchao makes again, without reducing the amaxes again; rowwise backward scales along other dims and
takes its amaxes afresh. Both keep the activation and the weight as forward got them (in the compute dtype, as
torchao does), so an FSDP weight is still kept as its shard and gathered again (regather.py): it is that
tensor autograd saves.
"""
from __future__ import annotations

import torch

from ..._compat import scaled_mm as _scaled_mm
from ...errors import AutoparError
from ..collectives import Comm, forward_phase
from ..float8_casts import E4M3, E5M2, reduce_max, scale_of, to_float8

DIM_MULTIPLE = 16    # the scaled matmul on a GPU: every dim it multiplies over, and the output's columns


def amax(x: torch.Tensor, axes: tuple, comm: Comm, phase: str, dim: int | None = None) -> torch.Tensor:
    """The largest magnitude in the whole tensor of which `x` is this rank's piece, split on mesh `axes`; with
    `dim`, of each row along `dim` (kept, size 1), where `axes` split that dim."""
    return reduce_max(x.abs().max() if dim is None else x.abs().amax(dim=dim, keepdim=True), axes, comm, phase)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column, as the scaled matmul takes its second operand."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, a_scale, b: torch.Tensor, b_scale, out_dtype, fast_accum: bool) -> torch.Tensor:
    """a @ b of two float8 matrices cast with scales `a_scale`, `b_scale` (one each, or a's per row and b's per
    column), in `out_dtype`."""
    return _scaled_mm(a.contiguous(), _column_major(b), a_scale.reciprocal(), b_scale.reciprocal(), out_dtype,
                      fast_accum)


def scaled_mm_then_scaled(a: torch.Tensor, a_scale, b: torch.Tensor, b_scale, out_dtype) -> torch.Tensor:
    """scaled_mm of per-row and per-column scales with exact accumulation, as torchao runs it: the plain float8
    matmul, then the product scaled (its rowwise kernel without fast accumulation is slow)."""
    one = a_scale.new_ones(())
    out = _scaled_mm(a.contiguous(), _column_major(b), one, one, out_dtype, False)
    out *= a_scale.reciprocal() * b_scale.reciprocal()
    return out


def input_scale(x: torch.Tensor, recipe: str, splits: tuple, comm: Comm, phase: str) -> torch.Tensor:
    """The forward scale of a float8 linear's activation `x` (this rank's piece): tensorwise, one from the whole
    tensor's amax; rowwise, one per row (along K, [M, 1]), rounded down to a power of 2."""
    (x_rows, x_in), _, _ = splits
    if recipe == "tensorwise":
        return scale_of(amax(x, x_rows + x_in, comm, phase), E4M3)
    return scale_of(amax(x.reshape(-1, x.shape[-1]), x_in, comm, phase, dim=-1), E4M3, power_of_2=True)


class Float8InputScale(torch.nn.Module):
    """The forward scale of an activation several float8 linears read in one layout (the query, key and value
    projections of one input): made once, its amax all-reduced once, and handed to each
    (Lowering.float8_shared_scales)."""

    def __init__(self, recipe: str, splits: tuple, comm: Comm, label: str):
        super().__init__()
        self.recipe, self.splits, self.comm, self.label = recipe, splits, comm, label

    def forward(self, x):
        with torch.no_grad():
            return input_scale(x, self.recipe, self.splits, self.comm, forward_phase())

    def extra_repr(self) -> str:
        return self.label


class _Tensorwise(torch.autograd.Function):
    """x @ w.t() in float8 (x: [..., K] in the compute dtype, w: [N, K]), one scale per tensor from the whole
    tensor's amax. `splits`: Float8Linear's; `x_scale`: the activation's, where a Float8InputScale made it."""

    @staticmethod
    def forward(ctx, x, w, splits: tuple, comm: Comm, x_scale=None):
        (x_rows, x_in), (w_out, w_in), ctx.grad_split = splits
        phase = forward_phase()
        if x_scale is None:
            x_scale = input_scale(x, "tensorwise", splits, comm, phase)
        w_scale = scale_of(amax(w, w_out + w_in, comm, phase), E4M3)
        x2 = x.reshape(-1, x.shape[-1])
        _check_rows(x2.shape[0], x.device)
        out = scaled_mm(to_float8(x2, x_scale, E4M3), x_scale, to_float8(w, w_scale, E4M3).t(), w_scale, x.dtype,
                        fast_accum=True)   # torchao's forward default; its backward matmuls accumulate exactly
        ctx.save_for_backward(x, w)
        # (two float32 scalars, kept beside what autograd saves: the activation model counts a linear's input and
        # weight, as for a linear in bf16, and these 8 bytes are not worth a term of their own)
        ctx.x_scale, ctx.w_scale, ctx.comm = x_scale, w_scale, comm
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x, w), x_scale, w_scale = ctx.saved_tensors, ctx.x_scale, ctx.w_scale
        g2 = grad.reshape(-1, grad.shape[-1])
        g_rows, g_out = ctx.grad_split
        g_scale = scale_of(amax(g2, g_rows + g_out, ctx.comm, "backward"), E5M2)
        g8 = to_float8(g2, g_scale, E5M2)
        grad_x = scaled_mm(g8, g_scale, to_float8(w, w_scale, E4M3), w_scale, grad.dtype, fast_accum=False)
        x8 = to_float8(x.reshape(-1, x.shape[-1]), x_scale, E4M3)
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale, grad.dtype, fast_accum=False)
        return grad_x.reshape(x.shape), grad_w, None, None, None


class _Rowwise(torch.autograd.Function):
    """x @ w.t() in float8 with torchao's rowwise recipe: each operand of each matmul scaled along the dim the
    matmul sums over (a row's, or a column's, amax), scales rounded down to powers of 2, every cast e4m3.
    Backward's operands sum over other dims than forward's, so it takes their amaxes afresh."""

    @staticmethod
    def forward(ctx, x, w, splits: tuple, comm: Comm, x_scale=None):
        (_, x_in), (_, w_in), _ = splits
        phase = forward_phase()
        x2 = x.reshape(-1, x.shape[-1])
        _check_rows(x2.shape[0], x.device)
        if x_scale is None:   # per row: [M, 1]
            x_scale = input_scale(x, "rowwise", splits, comm, phase)
        w_scale = scale_of(amax(w, w_in, comm, phase, dim=1), E4M3, power_of_2=True)    # per out row: [N, 1]
        out = scaled_mm(to_float8(x2, x_scale, E4M3), x_scale, to_float8(w, w_scale, E4M3).t(), w_scale.t(),
                        x.dtype, fast_accum=True)
        ctx.save_for_backward(x, w)
        ctx.splits, ctx.comm = splits, comm
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        (x_rows, _), (w_out, _), (g_rows, g_out) = ctx.splits
        comm, phase = ctx.comm, "backward"
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        # the input's gradient, [M, N] @ [N, K]: the gradient per row, the weight per column (over N)
        g_scale = scale_of(amax(g2, g_out, comm, phase, dim=-1), E4M3, power_of_2=True)
        w_scale = scale_of(amax(w, w_out, comm, phase, dim=0), E4M3, power_of_2=True)
        grad_x = scaled_mm_then_scaled(to_float8(g2, g_scale, E4M3), g_scale, to_float8(w, w_scale, E4M3), w_scale,
                                       grad.dtype)
        # the weight's gradient, [N, M] @ [M, K]: both over the rows M
        g_scale = scale_of(amax(g2, g_rows, comm, phase, dim=0), E4M3, power_of_2=True)
        x_scale = scale_of(amax(x2, x_rows, comm, phase, dim=0), E4M3, power_of_2=True)
        grad_w = scaled_mm_then_scaled(to_float8(g2, g_scale, E4M3).t(), g_scale.t(), to_float8(x2, x_scale, E4M3),
                                       x_scale, grad.dtype)
        return grad_x.reshape(x.shape), grad_w, None, None, None


class _TensorwiseGathered(torch.autograd.Function):
    """_Tensorwise of a weight its FSDP layer group gathers in float8 (reduction/layer_groups.py: torchao's
    enable_fsdp_float8_all_gather). The group casts each rank's shard with the whole weight's scale (the amax
    reduced over the shards) and gathers the float8 bytes: the bits one device casts, on half the bytes.
    Forward multiplies with them; backward reads them again (autograd saves them: gathered again where the plan
    reshards after forward, regather.py; kept where it does not) and hands the weight's whole gradient to the
    group, which reduce-scatters it with the layer's, as GroupGather's backward does. `gather`: the weight's
    RedistributeModule, which the group knows it by."""

    @staticmethod
    def forward(ctx, x, local, splits: tuple, comm: Comm, gather, phase: str, x_scale=None):
        _, _, ctx.grad_split = splits
        if x_scale is None:
            x_scale = input_scale(x, "tensorwise", splits, comm, phase)
        w8, w_scale = gather.group.gathered(gather.group_index, phase)
        if gather.gathered is not None:   # kept as the shard, gathered again by the group when backward reads it
            gather.gathered.register(w8, local.detach(), gather)
        x2 = x.reshape(-1, x.shape[-1])
        _check_rows(x2.shape[0], x.device)
        out = scaled_mm(to_float8(x2, x_scale, E4M3), x_scale, w8.t(), w_scale, x.dtype, fast_accum=True)
        ctx.save_for_backward(x, w8)
        ctx.x_scale, ctx.w_scale, ctx.comm, ctx.gather = x_scale, w_scale, comm, gather
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x, w8), x_scale, w_scale = ctx.saved_tensors, ctx.x_scale, ctx.w_scale
        g2 = grad.reshape(-1, grad.shape[-1])
        g_rows, g_out = ctx.grad_split
        g_scale = scale_of(amax(g2, g_rows + g_out, ctx.comm, "backward"), E5M2)
        g8 = to_float8(g2, g_scale, E5M2)
        grad_x = scaled_mm(g8, g_scale, w8, w_scale, grad.dtype, fast_accum=False)
        x8 = to_float8(x.reshape(-1, x.shape[-1]), x_scale, E4M3)
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale, grad.dtype, fast_accum=False)
        ctx.gather.group.arrive(ctx.gather.group_index, grad_w)
        return grad_x.reshape(x.shape), None, None, None, None, None, None


RECIPES = {"tensorwise": _Tensorwise, "rowwise": _Rowwise}


def _check_rows(rows: int, device: torch.device) -> None:
    """The weight gradient's matmul multiplies over the rows (tokens on this rank): a GPU takes multiples of 16."""
    if device.type == "cuda" and rows % DIM_MULTIPLE and not torch.compiler.is_dynamo_compiling():
        raise AutoparError(f"a float8 linear got {rows} rows (batch x sequence on this rank); the scaled matmul on "
                           f"a GPU needs a multiple of {DIM_MULTIPLE}: change the batch or sequence length, or plan "
                           "with precision='bf16-mixed'")


class Float8Linear(torch.nn.Module):
    """One captured linear run in float8 on this rank's pieces, by `recipe` ("tensorwise" or "rowwise").
    `splits`: the mesh axes that split (the activation's rows, its in_features), (the weight's out_features,
    its in_features), (the output gradient's rows, its out_features), over which each amax is reduced."""

    def __init__(self, splits: tuple, recipe: str, comm: Comm, label: str, gather=None):
        super().__init__()
        self.splits = tuple(tuple(tuple(axes) for axes in pair) for pair in splits)
        self.matmul, self.comm, self.label = RECIPES[recipe], comm, label
        # the weight's RedistributeModule, where its FSDP layer group gathers it in float8: `weight` is then the
        # local shard, and the group gathers it (a tensorwise linear only: the scale is one per weight)
        self.gather = gather

    def forward(self, x, weight, bias=None, x_scale=None):
        """`x_scale`: the activation's forward scale where a Float8InputScale made it for several linears."""
        if self.gather is not None and torch.compiler.is_dynamo_compiling():
            # compiled, no layer groups (Python state the compiler cannot trace): the weight's own layout change,
            # in the compute dtype, as RedistributeModule._compiled runs every gather (the module warns of it)
            weight = self.gather(weight)
        if self.gather is None or torch.compiler.is_dynamo_compiling():
            out = self.matmul.apply(x, weight, self.splits, self.comm, x_scale)
        else:
            group, i, phase = self.gather.group, self.gather.group_index, forward_phase()
            if phase != "recompute" and torch.is_grad_enabled() and weight.requires_grad:
                group.used(i)   # (a recompute's gradient never reaches the group; GroupGather's rule)
            out = _TensorwiseGathered.apply(x, weight, self.splits, self.comm, self.gather, phase, x_scale)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return self.label
