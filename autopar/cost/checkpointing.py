"""Activation checkpointing: which stacks of repeated blocks may be recomputed, and at what price.

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
from ..capture.export import Captured
from ..errors import AutoparError
from .activations import ActivationModel, activation_model

NONE, FULL = "none", "full"
MODES = (NONE, FULL, "auto")


@dataclass(frozen=True)
class CheckpointStack:
    path: str        # module path of the stack, e.g. "model.layers"
    blocks: tuple    # per block, its op nodes in graph order: one checkpointed region each

    @property
    def regions(self) -> list[frozenset]:
        return [frozenset(b) for b in self.blocks]


def checkpointable_stacks(cap: Captured) -> tuple[CheckpointStack, ...]:
    """Stacks of 2+ blocks whose ops each form one contiguous run of the graph."""
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
    return tuple(out)


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
        raise AutoparError(f"checkpointing={mode!r}: use 'auto' (the search decides per stack of repeated "
                           f"blocks), 'full' (recompute every such stack) or 'none'")
    return mode
