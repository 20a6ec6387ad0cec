"""Activation checkpointing: which stacks of repeated blocks may be recomputed, and at what price.

Two kinds, chosen per stack (`CheckpointStack.kind`):
- "full": each whole block is recomputed;
- "selective" (Megatron's): only each block's attention core -- the scores
  matmul, scale, softmax, dropout and the weighted sum of values, or one fused
  attention op -- whose activations grow with the square of the sequence while
  its compute is a small share of the block's.

A checkpointed block keeps nothing for backward but the tensors it reads
from outside (the checkpoint holds them); backward runs its forward again,
paying that block's forward compute (and its forward collectives) a second
time, and for the while one block's activations are alive again. That trade
-- memory for time -- is made per stack of repeated blocks (every block of a
stack alike), the unit Megatron and torchtitan checkpoint too.

A block can be checkpointed when its ops are one contiguous run of the
graph: the runtime cuts that run out into one checkpointed function
(recompute.py). The activation model with the stack checkpointed is the
ordinary one, told which ops run inside regions (activations.activation_model).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..capture.blocks import block_nodes
from ..capture.export import PARAM, Captured
from ..errors import AutoparError
from ..sharding.op_spec import op_name, tensor_args
from .activations import ActivationModel, activation_model

NONE, SELECTIVE, FULL, AUTO = "none", "selective", "full", "auto"
MODES = (NONE, SELECTIVE, FULL, AUTO)
KINDS = (SELECTIVE, FULL)
# ops that multiply two activations: attention's scores and its weighted sum of values
_PRODUCTS = {"aten.matmul.default", "aten.bmm.default", "aten.mm.default", "aten.einsum.default"}
_FUSED_ATTENTION = {"aten.scaled_dot_product_attention.default"}
# ops that only view or copy their input: the core starts with those that prepare its first product
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten.transpose.int", "aten.permute.default",
          "aten.expand.default", "aten.clone.default", "aten.contiguous.default", "aten._unsafe_view.default",
          "aten.t.default", "aten.unsqueeze.default"}


@dataclass(frozen=True)
class CheckpointStack:
    path: str        # module path of the stack, e.g. "model.layers"
    blocks: tuple    # per block, the op nodes of its region in graph order: one checkpointed region each
    kind: str = FULL   # FULL: each region is the whole block; SELECTIVE: its attention core

    @property
    def key(self) -> tuple:
        return (self.path, self.kind)

    @property
    def regions(self) -> list[frozenset]:
        return [frozenset(b) for b in self.blocks]


def checkpointable_stacks(cap: Captured) -> tuple[CheckpointStack, ...]:
    """Stacks of 2+ blocks whose ops each form one contiguous run of the graph, whole (FULL) and, where
    every block has an attention core, that core alone (SELECTIVE)."""
    position = {n.name: i for i, n in enumerate(n for n in cap.graph.nodes if n.op == "call_function")}
    out = []
    for path, blocks in block_nodes(cap).items():
        regions = []
        for _, nodes in sorted(blocks.items()):
            ops = [n.name for n in nodes if n.op == "call_function"]
            where = [position[n] for n in ops]
            if not ops or max(where) - min(where) + 1 != len(ops):
                break    # an op of another module sits inside the block: no single region to cut
            regions.append(tuple(ops))
        else:
            if len(regions) >= 2:
                out.append(CheckpointStack(path, tuple(regions)))
                cores = [attention_core(cap, block) for block in regions]
                if all(cores):
                    out.append(CheckpointStack(path, tuple(cores), SELECTIVE))
    return tuple(out)


def attention_core(cap: Captured, block: tuple) -> tuple:
    """The ops of a block's attention core, in graph order: from its first product of two activations
    (with the views just before it that prepare its operands) to the next one, or a fused attention
    op alone; () where the block has neither."""
    for i, name in enumerate(block):
        if op_name(cap.node(name)) in _FUSED_ATTENTION:
            return (name,)
    products = [i for i, name in enumerate(block) if op_name(cap.node(name)) in _PRODUCTS
                and not any(_from_weight(cap, a) for a in tensor_args(cap.node(name)))]
    if len(products) < 2:
        return ()
    start, end = products[0], products[1]
    while start > 0 and op_name(cap.node(block[start - 1])) in _VIEWS and \
            all(u.name in block[start:end + 1] for u in cap.node(block[start - 1]).users):
        start -= 1
    return tuple(block[start:end + 1])


def _from_weight(cap: Captured, node) -> bool:
    """Is this value a parameter, or a view of one?"""
    while True:
        if cap.info[node.name].kind == PARAM:
            return True
        if node.op != "call_function" or op_name(node) not in _VIEWS:
            return False
        node = tensor_args(node)[0]


def checkpointed_model(cap: Captured, hardware, stacks) -> ActivationModel:
    """What autograd keeps, and who pays, with every block of `stacks` checkpointed."""
    return activation_model(cap, hardware, regions=[r for s in stacks for r in s.regions])


def recomputed_ops(stack: CheckpointStack, saved: ActivationModel) -> set:
    """The ops backward reruns: in each block, up to the last op that keeps a tensor (`saved` is the
    model without checkpointing). torch.utils.checkpoint stops its rerun there (early stop): what
    follows keeps nothing for backward, so its result is not needed again."""
    out = set()
    for block in stack.blocks:
        last = max((i for i, n in enumerate(block) if n in saved.keepers), default=-1)
        out.update(block[:last + 1])
    return out


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise AutoparError(f"checkpointing={mode!r}: use 'auto' (the search decides for the stacks of repeated "
                           f"blocks), 'full' (recompute every block of each such stack), 'selective' (recompute "
                           f"only each block's attention core) or 'none'")
    return mode


def stacks_of(stacks, checkpointed) -> list:
    """The CheckpointStacks a plan's `checkpointed` ({stack path: kind}) names."""
    return [st for st in stacks if checkpointed.get(st.path) == st.kind]
