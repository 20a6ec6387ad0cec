"""Recompute: run the plan's checkpointed blocks under torch.utils.checkpoint.

The rewritten graph is flat; each checkpointed block is a contiguous run of
its nodes (checkpointing.checkpointable_stacks ensures it). That run is cut
out into a GraphModule of its own and called through `CheckpointRegion`,
which runs it under torch.utils.checkpoint (non-reentrant): forward keeps
only the region's inputs, and backward runs the region again -- its
collectives included (a TP all-reduce is paid twice; an FSDP weight is
gathered in the recompute instead of being gathered again for backward).

A redistribution that the first block made for a tensor later blocks read as
well (the rewriter makes one per producer and layout) is moved in front of
the region, so it runs once and the region takes its result as an input.

A region whose ops draw random numbers (dropout) must draw in its rerun what forward drew; its random
ops draw from autopar's streams (runtime/rng.py), which the rerun replays from a snapshot. That replay is
Python state torch.compile cannot trace, so such a region is an `EagerCheckpointRegion`: it runs eagerly,
forward and rerun alike, even inside a compiled module.

A per-op region (the plan's "per-op" kind, torchtitan's per-op selective checkpointing) caches the
results of the ops its SavePolicy names and recomputes the rest (per_op.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..collectives import Comm
from ..rng import RandomOp
from .per_op import per_op_compiled, per_op_eager


def recompute_all_but_logging():
    """torch.utils.checkpoint's context for a region backward runs again (compiled): every op of it is
    recomputed, except the op that logs a launch (record_comm), whose output -- the buffer the collective
    sends -- is kept instead: it is an effectful op, which the partitioner cannot recompute (inductor
    fails on one in a recomputed region). So with record_comm the log misses the recomputed launches."""
    return create_selective_checkpoint_contexts(
        lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE if op is torch.ops.autopar.logged_send.default
        else CheckpointPolicy.MUST_RECOMPUTE)


class CheckpointRegion(torch.nn.Module):
    """One block's nodes, run without keeping activations; `observer(inputs)`, if set, sees what
    the checkpoint holds (audit counts it): the region's inputs, and a per-op region's cached results.
    `policy`: a per-op region's SavePolicy (cost/checkpointing.py); None: every op is recomputed."""

    def __init__(self, body: fx.GraphModule, label: str, comm: Comm, policy=None):
        super().__init__()
        self.body, self.label, self.comm, self.policy = body, label, comm, policy
        self.observer = None

    def forward(self, *inputs):
        if self.observer is not None:
            self.observer(inputs)
        if torch.compiler.is_dynamo_compiling():
            # the compiler's partitioner reruns the region in backward from the graph itself; the counter
            # and the stream replay below are Python state it cannot trace, and need not: this region draws
            # no random numbers (outline makes one that does an EagerCheckpointRegion)
            context = recompute_all_but_logging if self.policy is None else per_op_compiled(self.policy, self.label)
            return checkpoint(self.body, *inputs, use_reentrant=False, context_fn=context)
        calls = [0]
        streams = self.comm.random_streams
        # torch.utils.checkpoint replays the default generators, not autopar's streams (rng.py): the rerun
        # starts them from where forward did, so it draws forward's dropout masks
        drawn_from = streams.snapshot()

        def run(*args):
            calls[0] += 1
            if calls[0] == 1:
                return self.body(*args)
            # backward's rerun (its collectives run as the recompute's: collectives.forward_phase)
            with streams.replaying(drawn_from):
                return self.body(*args)
        # every random op draws from autopar's streams, replayed above: the default generators need no saving
        # (and threaded ranks share them, so restoring them would race with another rank's draws)
        if self.policy is None:
            return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=False)
        counters: list = []
        out = checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=False,
                         context_fn=per_op_eager(self.policy, self.label, self.observer, counters))
        for counter in counters:   # none where grad is off: checkpoint then runs the region plainly
            counter.check()
        return out

    def extra_repr(self) -> str:
        return self.label


class EagerCheckpointRegion(CheckpointRegion):
    """A region whose ops draw random numbers: run eagerly even under torch.compile, so that its rerun
    replays forward's draws.

    Traced, the region would be a checkpoint the compiler reruns itself, without the stream replay, and
    its random ops (not compiled: rng.RandomOp) would draw new masks in backward from streams forward had
    advanced: gradients against masks forward never drew. The compiler could not compile the region's
    ops in any case: the checkpoint around them is one graph or none, and each random op breaks it."""

    @torch.compiler.disable
    def forward(self, *inputs):
        return super().forward(*inputs)


def draws_random(body: fx.GraphModule) -> bool:
    """Whether a region's ops draw random numbers (the rewriter runs each such op through a RandomOp)."""
    return any(isinstance(m, RandomOp) for m in body.modules())


def _hoist_shared(graph: fx.Graph, region: list) -> list:
    """Move nodes that read nothing from the region but feed nodes outside it in front of the region."""
    members = set(region)
    hoisted, kept = [], []
    for node in region:
        reads_region = any(a in members for a in node.all_input_nodes)
        if not reads_region and any(u not in members for u in node.users):
            hoisted.append(node)
            members.discard(node)
        else:
            kept.append(node)
    if not kept:
        # every node reads only from outside, or from nodes hoisted before it, and is read outside too: an
        # attention core of one op (SDPA). Checkpointed, that op still drops what it keeps beyond its inputs
        # (its output, its lse), as the plan priced it (cost/checkpointing.py); what it reads is hoisted
        inside = set(region)
        kept = [n for n in region if not any(u in inside for u in n.users)]
        hoisted = [n for n in region if n not in kept]
    for node in hoisted:   # in order, so each still follows what it reads
        kept[0].prepend(node)
    return kept


def outline(gm: fx.GraphModule, regions: list, labels: list, comm: Comm, policies=None) -> fx.GraphModule:
    """Replace each region (nodes of gm.graph, contiguous, in order) with one CheckpointRegion call;
    `policies`: per region, a per-op SavePolicy or None."""
    graph = gm.graph
    policies = policies or [None] * len(regions)
    for i, (region, label, policy) in enumerate(zip(regions, labels, policies)):
        region = _hoist_shared(graph, region)
        if not region:
            continue
        members = set(region)
        inputs = []
        for node in region:
            for a in node.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in region if any(u not in members for u in n.users)]
        body = fx.Graph()
        env = {a: body.placeholder(a.name) for a in inputs}
        for node in region:
            env[node] = body.node_copy(node, lambda a: env[a])
        body.output(tuple(env[n] for n in outputs))
        name = f"checkpoint_{i}"
        block = fx.GraphModule(gm, body, class_name="Block")
        kind = EagerCheckpointRegion if draws_random(block) else CheckpointRegion
        gm.add_module(name, kind(block, label, comm, policy))
        with graph.inserting_before(region[0]):
            call = graph.call_module(name, tuple(inputs))
            results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
        for node, result in zip(outputs, results):
            node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
        for node in reversed(region):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
