"""Overlap: how much of a step's communication the step waits for.

Most collectives the module launches are waited on at once: a TP all-reduce
feeds the next op, an FSDP all-gather the op that needs the weight, a
reduce-scatter the autograd function that issued it. Those are exposed:
the step takes compute + their time.

The gradient buckets (buckets.py, runtime/grad_buckets.py) and FSDP's
per-layer reduce-scatters (layer_groups.py) are not: each goes out
asynchronously as soon as backward has made its last gradient, and runs
while backward goes on through the earlier layers. The model, as DDP's
and the peers' (Megatron's overlap, AutoParallel's) simple ones:

    backward runs the forward ops in reverse; op i's backward takes
        (1 - 1/TRAIN_FLOPS_FACTOR) of its training time (2 of its 3 matmul passes)
    bucket k is ready once backward has passed the first use of each of its weights
    they go out one after another on their axis, as they become ready:
        start_k = max(ready_k, end_{k-1}),  end_k = start_k + time_k
    exposed = max(0, end_last - end of backward): the optimizer waits for the last bucket

A bucket summed over several axes reduces the first asynchronously and the
others when backward ends (runtime/grad_buckets.py), so only the first hides.
Nothing hides where the hardware says communication takes the compute's own
resources (`Hardware.comm_overlaps_compute`: CPU ranks using every core, whose
gloo reductions and copies then run on the cores backward needs).
The search itself prices communication as exposed (it cannot know the
buckets before it has chosen the layouts); this model prices the chosen plan.
"""
from __future__ import annotations

import cost_models as cm

from ..capture.export import OP
from ..sharding.op_spec import tensor_args
from ..sharding.redistribute import REDUCE_SCATTER
from .terms import collectives_time

BUCKET = "gradient bucket "   # the `where` of a bucket's all-reduce (predict.bucketed)
LAYER = "layer "              # the `where` of an FSDP layer's collectives (layer_groups.grouped)


def hidden_comm_time(prob, colls: list, op_times: dict) -> dict:
    """Axis name -> seconds of its communication that hide behind backward; `op_times`: op -> training
    seconds at the example's sizes. The collectives that can hide move weights' gradients, whose sizes
    do not depend on the shapes, so this is a number; the symbolic prediction takes it as it is (exposed
    = comm - hidden), which is exact at the example's sizes and keeps sympy out of the ordering."""
    mesh = prob.mesh
    if not prob.hardware.comm_overlaps_compute:   # the collectives take the cores backward runs on
        return {a: 0.0 for a in mesh.axis_names}
    queues: dict = {}   # axis index -> [(weights, seconds)] of the collectives that hide on it
    seen_bucket = set()
    for c in colls:
        if _hides(c, seen_bucket):
            queues.setdefault(c.axis, []).append((c.tensor.split(","), float(collectives_time([c], mesh, prob.links))))
    hidden = {a: 0.0 for a in mesh.axis_names}
    if not queues:
        return hidden
    ready, backward = _ready_times(prob, op_times, {n for q in queues.values() for names, _ in q for n in names})
    for axis, queue in queues.items():
        end = 0.0   # they go out one after another, as they become ready
        for names, t in sorted(queue, key=lambda item: max(ready[n] for n in item[0])):
            end = max(end, *(ready[n] for n in names)) + t
        hidden[mesh.axis_names[axis]] = sum(t for _, t in queue) - max(0.0, end - backward)
    return hidden


def _hides(c, seen_bucket: set) -> bool:
    """Launched asynchronously in backward and waited for at its end: a bucket's all-reduce on its first
    axis (the others follow when backward ends), an FSDP layer's reduce-scatter."""
    if c.where.startswith(BUCKET) and c.where not in seen_bucket:
        seen_bucket.add(c.where)
        return True
    return c.where.startswith(LAYER) and c.kind == REDUCE_SCATTER


def _ready_times(prob, op_times: dict, weights: set) -> tuple[dict, object]:
    """Seconds into backward at which each weight's gradient is whole on this rank (backward has passed
    its first use in forward), and backward's length."""
    ops = [n for n in prob.cap.graph.nodes if n.name in prob.cap.info and prob.cap.info[n.name].kind == OP]
    share = 1 - 1 / cm.TRAIN_FLOPS_FACTOR
    first_use: dict = {}
    for i, node in enumerate(ops):
        for a in tensor_args(node):
            if a.name in weights:
                first_use.setdefault(a.name, i)
    # after[i]: backward seconds of ops i.. (backward reaches op i once it has done every later one)
    after = [0] * (len(ops) + 1)
    for i in reversed(range(len(ops))):
        after[i] = after[i + 1] + op_times.get(ops[i].name, 0) * share
    return {w: float(after[first_use.get(w, 0)]) for w in weights}, float(after[0])
