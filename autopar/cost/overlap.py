"""Overlap: how much of a step's communication the step waits for.

Most collectives the module launches are waited on at once: a TP all-reduce
feeds the next op, a reduce-scatter the autograd function that issued it.
Those are exposed: the step takes compute + their time.

Four kinds are launched ahead of whatever waits for them, and hide behind
the compute that runs meanwhile:

    gradient buckets (buckets.py, runtime/reduction/grad_buckets.py) and FSDP's per-layer
        reduce-scatters (layer_groups.py): launched as soon as backward has made
        their last gradient, waited for when backward ends; a layer's
        reduce-scatter (and a ZeRO-2 bucket's) also waits for the one before it
        at its launch (the module keeps one in flight)
    FSDP's per-layer all-gathers in forward: a layer's first use launches the
        next layer's gather (runtime/reduction/layer_groups.py's prefetch), which runs
        while this layer computes; the first layer's is waited on whole
    FSDP's per-layer gathers in backward (a layer's re-gather, or a
        checkpointed block's recompute gather, below): likewise, each launches
        the one of the nearest layer before it (in forward order) that backward
        has not gathered or launched yet (a block whose weights form two groups,
        a norm's summed over tp apart, has the other one in hand already)
    a ring attention's key/value sends: each step launches the next chunk's
        before computing its own (ring_hidden)

The model, as DDP's, FSDP2's and the peers' simple ones (Megatron's overlap,
SimpleFSDP's): forward runs the ops in order, op i taking 1/TRAIN_FLOPS_FACTOR
of its training time, and backward runs them in reverse, taking the rest (2
of its 3 matmul passes); a layer is needed at its first forward use, and in
backward at its last one; a bucket is ready once backward has passed the first
use of each of its weights. Each axis is one link: its collectives run one
after another in launch order (start = max(launch, the link's last end)). The
compute waits where it needs what has not arrived, and the optimizer for what
is still in flight when backward ends: that waiting is the exposed part of
those collectives; the rest of them hides.

A bucket summed over several axes reduces the first asynchronously and the
others when backward ends (runtime/reduction/grad_buckets.py), so only the first hides.

A checkpointed block's FSDP gather in backward is its recompute's: the block
keeps none of its gathered weights (the checkpoint's own saved-tensor hooks
hold what its ops save, so nothing is re-gathered for backward), and its
rerun gathers the layer again (phase "recompute"), which serves the
backward's ops too. The module prefetches it as it does a re-gather
(runtime/reduction/layer_groups.LayerGroup.gathered; FSDP2's backward
prefetch): the block after it launches it, ahead of that block's own
reduce-scatter on the link, so it hides behind that block's rerun and
backward. The first one of backward is waited on whole (nothing before it
launches it). A recomputed op's forward runs twice: once in forward, once in
backward (its rerun, at the block's end in backward order, just before its
backward), so the timeline puts the rerun's time in backward.

Nothing hides where the hardware says communication takes the compute's own
resources (`Hardware.comm_overlaps_compute`: CPU ranks using every core, whose
gloo reductions and copies then run on the cores the compute needs).
The search itself prices communication as exposed (it cannot know the
buckets before it has chosen the layouts); this model prices the chosen plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import cost_models as cm

from ..capture.export import OP
from ..sharding.op_spec import tensor_args
from ..sharding.redistribute import ALL_GATHER, REDUCE_SCATTER
from .terms import RING_KEYS, collectives_time

RECOMPUTE = "recompute"       # the phase of a checkpointed block's collectives its rerun launches again
BUCKET = "gradient bucket "   # the `where` of a bucket's all-reduce (predict.bucketed)
LAYER = "layer "              # the `where` of an FSDP layer's collectives (layer_groups.grouped)


def hidden_comm_time(prob, colls: list, op_times: dict, rerun=frozenset()) -> dict:
    """Axis name -> seconds of its communication that hide behind compute; `op_times`: op -> training
    seconds at the example's sizes, a recomputed op's (`rerun`: their names) with its forward once more
    (predict._op_terms). The collectives that can hide move weights or their gradients, whose
    sizes do not depend on the shapes, so this is a number; the symbolic prediction takes it as it is
    (exposed = comm - hidden), which is exact at the example's sizes and keeps sympy out of the ordering."""
    mesh = prob.mesh
    hidden = {a: 0.0 for a in mesh.axis_names}
    if not prob.hardware.comm_overlaps_compute:   # the collectives take the cores the compute runs on
        return hidden
    for axis, seconds in ring_hidden(colls, op_times, mesh, prob.links, prob.cap.hints).items():
        hidden[axis] += seconds
    ops, uses = _op_uses(prob)
    gathers: dict = {"forward": [], "backward": []}   # a recompute's gathers are backward's (module docstring)
    at_end, seen_bucket = [], set()   # the collectives backward's end waits for
    for c in colls:
        names = c.tensor.split(",")
        gather = c.where.startswith(LAYER) and c.kind == ALL_GATHER and c.phase in (*gathers, RECOMPUTE)
        if not (gather or _hides(c, seen_bucket)) or not all(n in uses for n in names):
            continue   # waited on at once, or moves no weight the graph reads: exposed
        read = [u for n in names for u in uses[n]]
        move = _Move(c.axis, float(collectives_time([c], mesh, prob.links)), min(read), max(read),
                     _chain(c))
        (gathers["forward" if c.phase == "forward" else "backward"] if gather else at_end).append(move)
    moves = gathers["forward"] + gathers["backward"] + at_end
    if not moves:
        return hidden
    f = 1 / cm.TRAIN_FLOPS_FACTOR
    # forward: an op's forward once; backward: the rest, a recomputed op's rerun with it
    forward = [op_times.get(n.name, 0) * (f / (1 + f) if n.name in rerun else f) for n in ops]
    step = _Timeline()
    step.forward(forward, gathers["forward"])
    step.backward([op_times.get(n.name, 0) - t for n, t in zip(ops, forward)], gathers["backward"], at_end)
    for m in moves:
        hidden[mesh.axis_names[m.axis]] += m.seconds
    for axis, t in step.waited.items():
        hidden[mesh.axis_names[axis]] -= t
    return hidden


def _op_uses(prob) -> tuple:
    """(the graph's ops in order, tensor -> indices of the ops that read it), once per problem."""
    found = prob.node_cost_cache.get(("op uses",))
    if found is None:
        ops = [n for n in prob.cap.graph.nodes if n.name in prob.cap.info and prob.cap.info[n.name].kind == OP]
        uses: dict = {}   # weight -> indices of the ops that read it
        for i, node in enumerate(ops):
            for a in tensor_args(node):
                uses.setdefault(a.name, []).append(i)
        found = prob.node_cost_cache[("op uses",)] = (ops, uses)
    return found


def ring_hidden(colls: list, op_times: dict, mesh, links: dict, hints: dict) -> dict:
    """Axis name -> seconds of ring attentions' key/value sends in `colls` that hide behind their own compute:
    each of the n-1 sends is launched before a step's blocks and waited for after them, so it hides behind that
    step's share of the op's forward (or backward) time, (n-1)/n of it. The gradients' accumulator and the row
    swaps are waited on at once: exposed. `op_times`: op -> training seconds; `hints`: the example's sizes
    (symbol -> int), at which symbolic bytes are evaluated, as op_times are. The prediction
    (hidden_comm_time) and the search (problem.node_time) both price with it."""
    sends: dict = {}
    for c in colls:
        if c.kind == cm.SEND_RECV and c.tensor.endswith(RING_KEYS):
            key = (c.where, c.axis, "backward" if c.phase == "backward" else "forward")
            seconds = collectives_time([c], mesh, links)
            seconds = float(seconds.xreplace(hints) if hasattr(seconds, "xreplace") else seconds)
            sends[key] = sends.get(key, 0.0) + seconds
    hidden: dict = {}
    share = {"forward": 1 / cm.TRAIN_FLOPS_FACTOR, "backward": 1 - 1 / cm.TRAIN_FLOPS_FACTOR}
    for (op, axis, phase), seconds in sends.items():
        n = mesh.axis_sizes[axis]
        name = mesh.axis_names[axis]
        hidden[name] = hidden.get(name, 0.0) + min(seconds, op_times.get(op, 0.0) * share[phase] * (n - 1) / n)
    return hidden


def _hides(c, seen_bucket: set) -> bool:
    """Launched asynchronously in backward and waited for at its end: a bucket's all-reduce on its first
    axis (the others follow when backward ends), an FSDP layer's reduce-scatter."""
    if c.where.startswith(BUCKET) and c.where not in seen_bucket:
        seen_bucket.add(c.where)
        return True
    return c.where.startswith(LAYER) and c.kind == REDUCE_SCATTER


def _chain(c) -> str:
    """The collectives the module keeps one in flight of, this one's among them ("" if none): an FSDP
    layer's reduce-scatters (runtime/reduction/layer_groups.InFlight), ZeRO-2's buckets (runtime/reduction/zero_buckets.py)."""
    if c.where.startswith(LAYER) and c.kind == REDUCE_SCATTER:
        return "fsdp"
    return "zero2" if c.where.startswith(BUCKET + "ZeRO-2") else ""


@dataclass
class _Move:
    """One collective that can hide: its axis, its seconds, the first and last forward op reading the
    weights it moves, and the chain whose launch waits for the one before (_chain)."""
    axis: int
    seconds: float
    first: int
    last: int
    chain: str = ""


@dataclass
class _Timeline:
    """The clock of one step's compute and the time each axis's link is busy until; `waited`: axis ->
    seconds the compute (or the optimizer) waited for that axis's collectives."""
    clock: float = 0.0
    link: dict = field(default_factory=dict)
    waited: dict = field(default_factory=dict)

    def launch(self, m: _Move) -> float:
        """Launch m now: the time it will have arrived."""
        end = max(self.clock, self.link.get(m.axis, 0.0)) + m.seconds
        self.link[m.axis] = end
        return end

    def wait(self, axis: int, until: float) -> None:
        if until > self.clock:
            self.waited[axis] = self.waited.get(axis, 0.0) + until - self.clock
            self.clock = until

    def need_layer(self, layers: list, k: int, step: int, arriving: dict) -> None:
        """Layer k is used: wait for its gather (launched ahead of time, or now), then launch the one of
        layer k + step (forward: the next layer) unless it has been launched already, or, backward
        (step -1), of the nearest layer before k not launched yet (`arriving`: layer -> when its gather
        arrives, None once used)."""
        self.wait(layers[k].axis, arriving[k] if arriving.get(k) is not None else self.launch(layers[k]))
        arriving[k] = None
        ahead = k + step
        while step < 0 and ahead in arriving:
            ahead -= 1
        if 0 <= ahead < len(layers) and ahead not in arriving:
            arriving[ahead] = self.launch(layers[ahead])

    def forward(self, times: list, layers: list) -> None:
        """Forward through the ops: each layer gathered at its first use, prefetching the next one."""
        layers = sorted(layers, key=lambda m: (m.first, m.last))
        needed = _by_op(range(len(layers)), lambda k: layers[k].first)
        arriving: dict = {}
        for i, t in enumerate(times):
            for k in needed.get(i, ()):
                self.need_layer(layers, k, 1, arriving)
            self.clock += t

    def backward(self, times: list, layers: list, at_end: list) -> None:
        """Backward through the ops in reverse: a layer re-gathered at its last use prefetches the nearest
        one before it not launched yet (`layers`: backward's re-gathers and the recompute's gathers, a block's rerun needing
        its layer at its last use too); the buckets and layer reduce-scatters
        launch once backward has passed the first use of their weights, and the optimizer waits for the
        last of them."""
        layers = sorted(layers, key=lambda m: (m.first, m.last))
        needed = _by_op(range(len(layers)), lambda k: layers[k].last)
        ready = _by_op(at_end, lambda m: m.first)
        arriving: dict = {}
        in_flight: dict = {}   # chain -> when its last launched collective arrives
        pending: dict = {}   # axis -> when its last collective the optimizer waits for arrives
        for i in reversed(range(len(times))):
            for k in needed.get(i, ()):
                self.need_layer(layers, k, -1, arriving)
            self.clock += times[i]
            for m in ready.get(i, ()):
                if m.chain in in_flight:
                    self.wait(m.axis, in_flight[m.chain])
                end = self.launch(m)
                if m.chain:
                    in_flight[m.chain] = end
                pending[m.axis] = max(pending.get(m.axis, 0.0), end)
        for axis, end in sorted(pending.items(), key=lambda kv: kv[1]):
            self.wait(axis, end)


def _by_op(items, op_of) -> dict:
    """op index -> the items (in their order) that op_of places there."""
    out: dict = {}
    for item in items:
        out.setdefault(op_of(item), []).append(item)
    return out
