"""What running an op on a rank's shards takes beyond the op itself on its local tensors, under one strategy.

Most ops run as traced, on their local tensors. Some need to know how the plan splits them:
  - a shape argument (view, expand, new_zeros, ...) is in global terms: divided by the split of each dim;
  - a size read (sym_size) of a local tensor is multiplied back by the split of the dim it reads;
  - an attention whose query rows and keys split together runs as a ring (runtime/lowering/ring_attention.py);
  - a cross-entropy, or an embedding, over a split vocabulary runs on this rank's classes or rows
    (runtime/lowering/vocab_parallel.py);
  - a causal attention whose query rows split masks at its rows' offset (runtime/lowering/context_parallel.py);
  - an op that draws random numbers draws from the stream of its output's shard (runtime/rng.py).
`local_op` says which, and with what, as a LocalOp. Planning records one for each op that needs one
(planning/lowering.Lowering.ops), so the rewriter (runtime/lowering/rewrite.py) reads what the plan decided
instead of asking the rules again. What an op needs is read from its arguments and the strategy's layouts with
the rules' own functions (rules.ring_axes, ...), which the cost model prices the same ops by.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..capture.export import Captured
from .op_spec import op_arg, op_name
from .placement import R, dim_factor, is_shard, shard_dim
from .rules import causal_rows_split_axes, ring_axes, ring_repeats, vocab_split_axes

# ops whose argument 1 is a shape (in global terms, as traced)
SHAPE_ARG_OPS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                 "aten.expand.default", "aten.new_zeros.default", "aten.new_ones.default",
                 "aten.new_empty.default", "aten.new_full.default"}
SYM_SIZE = "aten.sym_size.int"

# ops whose result is a random draw: every overload whose name starts so
_RANDOM_OPS = ("aten.bernoulli", "aten.rand", "aten.normal", "aten.uniform", "aten.exponential", "aten.cauchy",
               "aten.log_normal", "aten.geometric", "aten.multinomial", "aten.poisson")
# these draw only in training, with p > 0: (dropout, p) as named in their schemas
_DROPOUT_OPS = ("aten.dropout", "aten.native_dropout", "aten.feature_dropout", "aten.alpha_dropout",
                "aten.feature_alpha_dropout")
_ATTENTION_OPS = ("aten.scaled_dot_product_attention", "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu")


@dataclass(frozen=True)
class Ring:
    """Attention run as a ring on mesh axis `axis` (runtime/lowering/ring_attention.RingAttention's arguments):
    its is_causal, scale and enable_gqa, and how many copies of each key/value head its keys hold (rules.ring_repeats)."""
    axis: int
    causal: bool
    scale: float | None
    gqa: bool
    repeats: int


@dataclass(frozen=True)
class VocabLoss:
    """A cross-entropy whose classes (dim 1 of its logits) `axes` split, `per_rank` classes each (the chunk a rank
    holds: row-major over its coordinates on `axes`, placement.chunk_index's order); its ignore_index and
    label_smoothing (runtime/lowering/vocab_parallel.VocabParallelCrossEntropy)."""
    axes: tuple
    num_classes: int
    per_rank: int
    ignore_index: int
    smoothing: float


@dataclass(frozen=True)
class VocabLookup:
    """An embedding whose table's rows `axes` split, `per_rank` rows each (chunks as VocabLoss's), and its
    padding_idx in the whole table (runtime/lowering/vocab_parallel.vocab_parallel_embedding)."""
    axes: tuple
    per_rank: int
    padding_idx: int


@dataclass(frozen=True)
class LocalOp:
    """How the rewriter runs one captured op on a rank's shards, where that is more than the op on its local
    tensors; the defaults (PLAIN) are an op that runs as traced."""
    # a shape-argument op (SHAPE_ARG_OPS): per dim of its output, the pieces the plan cuts it into (its shape
    # argument divided by them); () where none is cut
    shape_factors: tuple = ()
    # a size read (sym_size): the pieces the plan cuts the dim it reads into (the local size multiplied by them)
    size_factor: int = 1
    ring: Ring | None = None
    vocab_loss: VocabLoss | None = None
    vocab_lookup: VocabLookup | None = None
    # a causal attention whose query rows these mesh axes split (rules.causal_rows_split_axes): masked at the
    # offset of this rank's chunk of rows (row-major over its coordinates on them)
    causal_rows: tuple = ()
    # an op that draws random numbers: the mesh axes whose coordinates name the stream it draws from (those that
    # split its output; () the one stream every rank shares); None for an op that draws none
    random: tuple | None = None


PLAIN = LocalOp()


def local_op(cap: Captured, node: fx.Node, strategies: dict, axis_sizes) -> LocalOp:
    """How call_function `node` of `cap` runs on a rank's shards under the plan's `strategies` (node name ->
    Strategy; a node without one is replicated); PLAIN for an op that runs as traced."""
    s = strategies.get(node.name)
    return LocalOp(_shape_factors(node, s, axis_sizes), _size_factor(node, strategies, axis_sizes),
                   _ring(cap, node, s, axis_sizes), _vocab_loss(node, s, axis_sizes),
                   vocab_lookup(node, s, axis_sizes), causal_rows_split_axes(node, s, axis_sizes),
                   random_axes(node, s, axis_sizes))


def _shape_factors(node: fx.Node, strategy, axis_sizes) -> tuple:
    if op_name(node) not in SHAPE_ARG_OPS or strategy is None:
        return ()
    factors = tuple(dim_factor(strategy.output, d, axis_sizes) for d in range(len(node.args[1])))
    return factors if any(f > 1 for f in factors) else ()


def _size_factor(node: fx.Node, strategies: dict, axis_sizes) -> int:
    """The split of the dim a sym_size reads, in the layout the plan gives the tensor it reads."""
    if op_name(node) != SYM_SIZE:
        return 1
    read = strategies.get(node.args[0].name)
    return dim_factor(read.output if read is not None else (R,) * len(axis_sizes), node.args[1], axis_sizes)


def _ring(cap: Captured, node: fx.Node, strategy, axis_sizes) -> Ring | None:
    axes = ring_axes(node, strategy, axis_sizes)
    if not axes:
        return None
    (axis,) = axes   # one axis alone splits a ring's rows and keys (rules.ring_fits)
    return Ring(axis, bool(op_arg(node, 5, "is_causal", False)), op_arg(node, 6, "scale", None),
                bool(op_arg(node, 7, "enable_gqa", False)), ring_repeats(node, cap, strategy, axis_sizes))


def _vocab_loss(node: fx.Node, strategy, axis_sizes) -> VocabLoss | None:
    axes = vocab_split_axes(node, strategy, axis_sizes)
    if not axes:
        return None
    num_classes = int(node.args[0].meta["val"].shape[1])
    per_rank = num_classes // dim_factor(strategy.inputs[0], 1, axis_sizes)   # the strategies keep only splits that divide
    return VocabLoss(axes, num_classes, per_rank, int(op_arg(node, 4, "ignore_index", -100)),
                     float(op_arg(node, 5, "label_smoothing", 0.0)))


def vocab_lookup(node: fx.Node, strategy, axis_sizes) -> VocabLookup | None:
    """An embedding whose table's rows (the vocabulary) the strategy splits, as a VocabLookup; else None."""
    if op_name(node) != "aten.embedding.default" or strategy is None:
        return None
    weight = strategy.inputs[0]
    axes = tuple(a for a, p in enumerate(weight) if shard_dim(p) == 0 and axis_sizes[a] > 1)
    if not axes:
        return None
    # scale_grad_by_freq and sparse never get here: embedding_rule keeps such a lookup whole
    vocab = int(node.args[0].meta["val"].shape[0])
    return VocabLookup(axes, vocab // dim_factor(weight, 0, axis_sizes), int(op_arg(node, 2, "padding_idx", -1)))


def random_axes(node: fx.Node, strategy, axis_sizes) -> tuple | None:
    """The mesh axes whose coordinates name the random stream `node` draws from under `strategy`: those that split
    its output (ranks holding one shard draw the same numbers, ranks holding others independent ones: rng.py);
    None where it draws no random numbers."""
    if not draws_random(node):
        return None
    output = strategy.output if strategy is not None else (R,) * len(axis_sizes)
    return tuple(a for a, p in enumerate(output) if is_shard(p) and axis_sizes[a] > 1)


def draws_random(node: fx.Node) -> bool:
    """Whether captured `node` draws random numbers when it runs (dropout with p = 0 or in eval does not)."""
    name = op_name(node)
    if name.startswith(_DROPOUT_OPS):
        return op_arg(node, 1, "p", 0.0) != 0 and op_arg(node, 2, "train", True) is not False
    if name.startswith(_ATTENTION_OPS):
        return op_arg(node, 4, "dropout_p", 0.0) != 0
    if name.startswith("aten.rrelu"):
        return bool(op_arg(node, 3, "training", False))
    return name.startswith(_RANDOM_OPS)
