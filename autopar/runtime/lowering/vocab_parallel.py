"""Ops whose vocabulary is split over ranks: the embedding lookup and the cross-entropy.

Both are what Megatron does for a tensor-parallel vocabulary. Each rank holds
rows (classes) [start, start + local) of the vocabulary; the lookup returns
zeros for tokens another rank holds, and the loss is each rank's share of
every position's loss. Either way the ranks' outputs are partial sums (P):
the plan's usual all-reduce (or the sum that follows) makes them whole, so
neither the table nor the logits are ever gathered.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.fx as fx

from ...sharding.op_spec import op_arg, op_name
from ...sharding.placement import chunk_index, dim_factor
from ...sharding.rules import vocab_split_axes
from ...sharding.redistribute import ALL_REDUCE
from ..collectives import Comm, forward_phase, logged


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, start: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Embedding over rows [start, start + len(weight)) of the vocab; zeros for other tokens.

    The ranks' outputs sum to the whole lookup (a partial-sum layout), and
    gradients reach only the rows this rank holds. `padding_idx` is the
    padding row in this rank's slice (-1: none here), whose gradient stays 0
    as on one device (BERT's row 0).
    """
    local = indices - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _all_reduce(x: torch.Tensor, op, comm: Comm, axes: tuple) -> torch.Tensor:
    """`x` reduced with `op` over each of `axes` in turn (over all of them: the axes that split the vocab)."""
    for a in axes:
        x = logged(x, comm, ALL_REDUCE, a, x.numel() * x.element_size(), forward_phase())
        t0 = comm.start()
        dist.all_reduce(x, op=op, group=comm.axes[a].group)
        comm.stop(a, t0)
    return x


class _CrossEntropy(torch.autograd.Function):
    """Per-position loss share from this rank's slice of the classes (dim 1 of x).

    With lse the log-sum-exp over all classes, one device's loss at a position is
        lse - (1 - eps) * x[t] - eps / C * sum_c x[c]     (0 where t == ignore_index)
    and its gradient is softmax(x) - (1 - eps) * onehot(t) - eps / C. Each rank
    returns lse / n minus the target and smoothing terms of its own classes, so
    the ranks' outputs sum to the loss; lse needs two all-reduces of one number
    per position (the max, then the sum of exponentials). Backward needs no
    communication: the gradient of this rank's slice is that slice of the
    formula, kept from forward as one tensor shaped and typed like x's slice.
    """

    @staticmethod
    def forward(ctx, x, target, start: int, num_classes: int, ignore_index: int, smoothing: float,
                comm: Comm, axes: tuple):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))   # bf16 logits: fp32 sums, as aten's kernel
        # the max only keeps exp() in range: any value common to all ranks gives the same loss
        top = _all_reduce(xf.amax(dim=1), dist.ReduceOp.MAX, comm, axes)
        shifted = xf - top.unsqueeze(1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=1), dist.ReduceOp.SUM, comm, axes)
        lse = total.log() + top
        local = target - start
        inside = (local >= 0) & (local < x.shape[1])
        valid = target != ignore_index
        index = local.masked_fill(~inside, 0).unsqueeze(1)
        picked = xf.gather(1, index).squeeze(1).masked_fill(~inside, 0.0)
        num_ranks = math.prod(comm.axes[a].size for a in axes)
        loss = lse / num_ranks - (1.0 - smoothing) * picked
        if smoothing:
            loss = loss - smoothing / num_classes * xf.sum(dim=1)
        loss = loss.masked_fill(~valid, 0.0)
        grad = exp.div_(total.unsqueeze(1))
        grad.scatter_add_(1, index, (-(1.0 - smoothing) * inside.to(grad.dtype)).unsqueeze(1))
        if smoothing:
            grad.sub_(smoothing / num_classes)
        grad.mul_(valid.unsqueeze(1))
        ctx.save_for_backward(grad.to(x.dtype))
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return g.unsqueeze(1) * grad, None, None, None, None, None, None, None


class VocabParallelCrossEntropy(torch.nn.Module):
    """cross_entropy(x, t, reduction="none") with x split along its classes over `axes`: this rank's
    share of each position's loss (a partial sum over those axes)."""

    def __init__(self, comm: Comm, axes: tuple, start: int, num_classes: int, ignore_index: int,
                 label_smoothing: float):
        super().__init__()
        self.comm, self.axes, self.start, self.num_classes = comm, axes, start, num_classes
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _CrossEntropy.apply(x, target, self.start, self.num_classes, self.ignore_index,
                                   self.label_smoothing, self.comm, self.axes)

    def extra_repr(self) -> str:
        return f"classes [{self.start}, ...) of {self.num_classes} split over axes {list(self.axes)}"


def vocab_parallel_loss(node: fx.Node, strategy, comm: Comm, coords, sizes) -> VocabParallelCrossEntropy:
    """The module that runs cross-entropy `node` on this rank's slice of the classes."""
    ignore_index, smoothing = op_arg(node, 4, "ignore_index", -100), op_arg(node, 5, "label_smoothing", 0.0)
    num_classes = node.args[0].meta["val"].shape[1]
    pl = strategy.inputs[0]
    local = num_classes // dim_factor(pl, 1, sizes)   # the strategies keep only splits that divide
    start = chunk_index(pl, 1, coords, sizes) * local
    return VocabParallelCrossEntropy(comm, vocab_split_axes(node, strategy, sizes), start, int(num_classes),
                                     int(ignore_index), float(smoothing))


def local_target(node: fx.Node, strategy, coords, sizes):
    """The callable and extra trailing args that run `node` on this rank's shards.

    Almost always the op itself; an embedding whose table is split along the
    vocab becomes a masked lookup of this rank's rows.
    """
    if op_name(node) == "aten.embedding.default" and strategy is not None:
        weight_pl = strategy.inputs[0]
        f = dim_factor(weight_pl, 0, sizes)
        if f > 1:
            vocab = node.args[0].meta["val"].shape[0]
            rows = vocab // f
            start = chunk_index(weight_pl, 0, coords, sizes) * rows
            padding_idx = op_arg(node, 2, "padding_idx", -1)
            # the padding row in this rank's slice, -1 where another rank holds it (or none is:
            # F.embedding has already turned a negative padding_idx into a row, so aten's is -1)
            local_pad = padding_idx - start if start <= padding_idx < start + rows else -1
            # scale_grad_by_freq and sparse never get here: embedding_rule keeps such a lookup whole
            return vocab_parallel_embedding, (start, local_pad)
    return node.target, ()
