"""Activation checkpointing: which stacks of repeated blocks may be recomputed, and at what price.

Three kinds, chosen per stack (`CheckpointStack.kind`):
- "full": each whole block is recomputed;
- "selective" (Megatron's): only each block's attention core -- the scores
  matmul, scale, softmax, dropout and the weighted sum of values, or one fused
  attention op -- whose activations grow with the square of the sequence while
  its compute is a small share of the block's;
- "per-op" (torchtitan's per-op selective checkpointing): each whole block is
  one region, but the results of its fused attention kernels and of every
  second matmul (the 1st, 3rd, ... of the block, counting every op that runs
  as aten.mm or aten.addmm) are cached in forward and not recomputed; every
  other op (norms, rotary, activations, the other matmuls) is. In a Llama
  block (q, k, v, o, gate, up, down) q, v, gate and down are cached.
  torchtitan lists aten.mm only (its models have no biases); a linear with a
  bias runs as addmm, counted here alike. torchtitan also caches
  reduce_scatter outputs; autopar's rerun runs its collectives again (priced);
- "per-layer" (torchtitan's layer selective checkpointing, ac_freq 2): every
  second block of a stack (the 2nd, 4th, ...: torchtitan counts blocks from 1
  and checkpoints those the frequency divides) is recomputed whole, the
  others keep their activations.

A checkpointed block keeps nothing for backward but the tensors it reads
from outside (the checkpoint holds them); backward runs its forward again,
paying that block's forward compute (and its forward collectives) a second
time, and for the while one block's activations are alive again. A per-op
block keeps besides what it caches (its ops' outputs, an attention's
logsumexp too) and reruns all but the cached ops; the rerun still computes a
cached op's inputs (it runs the block's function again), so the collectives
before a cached op run again too. That trade
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
from .saved_tensors import Out, kernel_family, op_keeps

NONE, SELECTIVE, FULL, PER_OP, PER_LAYER, AUTO = "none", "selective", "full", "per-op", "per-layer", "auto"
MODES = (NONE, SELECTIVE, FULL, PER_OP, PER_LAYER, AUTO)
KINDS = (SELECTIVE, FULL, PER_OP, PER_LAYER)
# torchtitan's layer selective checkpointing: every AC_FREQ-th block of a stack (the 2nd, 4th, ...) is checkpointed
AC_FREQ = 2
# ops that multiply two activations: attention's scores and its weighted sum of values
_PRODUCTS = {"aten.matmul.default", "aten.bmm.default", "aten.mm.default", "aten.einsum.default"}
_FUSED_ATTENTION = {"aten.scaled_dot_product_attention.default"}
# captured ops that run as one aten.mm or aten.addmm (a linear's matmul, with its bias or without)
_MM = {"aten.linear.default", "aten.mm.default", "aten.addmm.default"}
# ops that only view or copy their input: the core starts with those that prepare its first product
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten.transpose.int", "aten.permute.default",
          "aten.expand.default", "aten.clone.default", "aten.contiguous.default", "aten._unsafe_view.default",
          "aten.t.default", "aten.unsqueeze.default"}


@dataclass(frozen=True)
class CheckpointStack:
    path: str        # module path of the stack, e.g. "model.layers"
    blocks: tuple    # per checkpointed block, the op nodes of its region in graph order: one region each
    kind: str = FULL   # FULL, PER_OP: each region is the whole block; SELECTIVE: its attention core;
    #                    PER_LAYER: every AC_FREQ-th block whole, the others not checkpointed
    # PER_OP: per block, the SavePolicy the runtime caches by (its `cached` ops keep their results)
    policies: tuple = ()

    @property
    def cached(self) -> frozenset:
        """The ops whose results the checkpoint caches (PER_OP), of every block."""
        return frozenset(n for p in self.policies for n in p.cached)

    @property
    def key(self) -> tuple:
        return (self.path, self.kind)

    @property
    def regions(self) -> list[frozenset]:
        return [frozenset(b) for b in self.blocks]


def checkpointable_stacks(cap: Captured, hardware) -> tuple[CheckpointStack, ...]:
    """Stacks of 2+ blocks whose ops each form one contiguous run of the graph, whole (FULL, PER_OP with
    what it caches on `hardware`'s kernels, and every second block whole: PER_LAYER) and, where every block
    has an attention core, that core alone (SELECTIVE)."""
    kernels = kernel_family(hardware)
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
                out.append(CheckpointStack(path, tuple(regions), PER_OP,
                                           tuple(save_policy(cap, block, kernels) for block in regions)))
                out.append(CheckpointStack(path, tuple(regions[AC_FREQ - 1::AC_FREQ]), PER_LAYER))
                cores = [attention_core(cap, block) for block in regions]
                if all(cores):
                    out.append(CheckpointStack(path, tuple(cores), SELECTIVE))
    return tuple(out)


@dataclass(frozen=True)
class SavePolicy:
    """What a per-op checkpoint of one block caches, by position in the block: of the ops the block runs as
    aten.mm or aten.addmm, in order, whether each is cached (`matmuls`); likewise of its fused attention kernels
    (`attentions`). Counted by position, the runtime's policy (runtime/lowering/recompute.py) caches exactly
    the ops priced here, eager or compiled, whichever rank and layout runs the block."""
    matmuls: tuple      # bools, one per op that runs as one aten.mm / aten.addmm
    attentions: tuple   # bools, one per fused attention kernel
    cached: tuple       # the captured ops cached, in graph order


def save_policy(cap: Captured, block: tuple, kernels: str) -> SavePolicy:
    """torchtitan's per-op policy for one block: every second matmul (the 1st, 3rd, ...) and every fused
    attention kernel cached. An attention that runs as the math fallback on `kernels` is ordinary ops
    (matmuls of 4-d tensors, softmax), recomputed."""
    matmuls, attentions, cached = [], [], []
    for name in block:
        node = cap.node(name)
        if _runs_as_mm(cap, node):
            matmuls.append(len(matmuls) % 2 == 0)
            keep = matmuls[-1]
        elif op_name(node) in _FUSED_ATTENTION and Out() in op_keeps(node, cap, kernels):
            attentions.append(True)
            keep = True
        else:
            continue
        if keep:
            cached.append(name)
    return SavePolicy(tuple(matmuls), tuple(attentions), tuple(cached))


def _runs_as_mm(cap: Captured, node) -> bool:
    """Does this captured op run as one aten.mm or aten.addmm (a matmul of a 2-d right operand folds the left
    one's leading dims into one)?"""
    if op_name(node) in _MM:
        return True
    if op_name(node) != "aten.matmul.default":
        return False
    a, b = (cap.info[x.name].meta for x in tensor_args(node)[:2])
    return getattr(b, "ndim", 0) == 2 and getattr(a, "ndim", 0) >= 2


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
    return activation_model(cap, hardware, regions=[r for s in stacks for r in s.regions],
                            cached=frozenset().union(*(s.cached for s in stacks)))


def rerun_ops(stack: CheckpointStack, saved: ActivationModel) -> set:
    """The ops backward's rerun passes: in each block, up to the last op that keeps a tensor (`saved` is the
    model without checkpointing). torch.utils.checkpoint stops its rerun there (early stop): what follows
    keeps nothing for backward, so its result is not needed again. The redistributions before them run
    again, a cached op's (PER_OP) too: the rerun computes its inputs, then takes its result from the cache."""
    out = set()
    for block in stack.blocks:
        last = max((i for i, n in enumerate(block) if n in saved.keepers), default=-1)
        out.update(block[:last + 1])
    return out


def rerun_blocks(stack: CheckpointStack, saved: ActivationModel) -> list[tuple]:
    """The blocks of `stack` whose checkpoint reruns in backward: those with an op that keeps a tensor for
    backward (`saved`: without checkpointing). A block of frozen weights that reads nothing needing a gradient
    keeps none, and backward never enters it (the bottom blocks of a fine-tuned model)."""
    return [block for block in stack.blocks if any(n in saved.keepers for n in block)]


def recomputed_ops(stack: CheckpointStack, saved: ActivationModel) -> set:
    """The ops whose forward backward's rerun computes again (compute and the collectives they launch
    themselves): rerun_ops less those a per-op checkpoint cached."""
    return rerun_ops(stack, saved) - stack.cached


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise AutoparError(f"checkpointing={mode!r}: use 'auto' (the search decides for the stacks of repeated "
                           f"blocks), 'full' (recompute every block of each such stack), 'selective' (recompute "
                           f"only each block's attention core), 'per-op' (recompute each block but its attention "
                           f"and every second matmul, torchtitan's per-op selective checkpointing), 'per-layer' (recompute every "
                           f"second block whole, torchtitan's layer selective checkpointing) or 'none'")
    return mode


def stacks_of(stacks, checkpointed) -> list:
    """The CheckpointStacks a plan's `checkpointed` ({stack path: kind}) names."""
    return [st for st in stacks if checkpointed.get(st.path) == st.kind]
