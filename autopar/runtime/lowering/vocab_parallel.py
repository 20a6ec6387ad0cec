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

from ...sharding.local_ops import VocabLookup, VocabLoss, vocab_lookup
from ...sharding.redistribute import ALL_REDUCE
from ..collectives import Comm, forward_phase, logged, rank_chunk


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


def vocab_parallel_loss(loss: VocabLoss, comm: Comm, coords, sizes) -> VocabParallelCrossEntropy:
    """The module that runs a cross-entropy on this rank's slice of the classes, as the plan records it."""
    chunk, _ = rank_chunk(loss.axes, coords, sizes)
    return VocabParallelCrossEntropy(comm, loss.axes, chunk * loss.per_rank, loss.num_classes, loss.ignore_index,
                                     loss.smoothing)


def local_target(node: fx.Node, strategy, coords, sizes):
    """The callable and extra trailing args that run `node` on this rank's shards.

    Almost always the op itself; an embedding whose table is split along the
    vocab becomes a masked lookup of this rank's rows. The rewriter reads the
    plan's record instead (LocalOp.vocab_lookup, which planning makes with the
    same sharding/local_ops.vocab_lookup) and calls lookup_target on it.
    """
    return lookup_target(vocab_lookup(node, strategy, sizes), node.target, coords, sizes)


def lookup_target(lookup: VocabLookup | None, target, coords, sizes):
    """`target` and no extra args, or for an embedding over a split vocabulary (`lookup`), the masked lookup of
    this rank's rows and its (start row, padding row)."""
    if lookup is None:
        return target, ()
    chunk, _ = rank_chunk(lookup.axes, coords, sizes)
    start = chunk * lookup.per_rank
    # the padding row in this rank's slice, -1 where another rank holds it (or none is:
    # F.embedding has already turned a negative padding_idx into a row, so aten's is -1)
    local_pad = lookup.padding_idx - start if start <= lookup.padding_idx < start + lookup.per_rank else -1
    return vocab_parallel_embedding, (start, local_pad)
