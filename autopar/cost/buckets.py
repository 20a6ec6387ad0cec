"""Gradient buckets as the plan predicts them: which weights' data-axis reductions are bucketed, and how.

The runtime (runtime/grad_buckets.py) all-reduces the gradients of weights
replicated on a data axis in flat buckets after their last use in backward,
as DDP does; the plan's list of collectives must show those buckets, not one
all-reduce per weight, or its bytes per call and its latency terms would not
be what the module does. Both sides call the two functions here, so they
cannot disagree.
"""
from __future__ import annotations

from ..capture.export import PARAM, Captured
from ..sharding.op_spec import tensor_args
from ..sharding.placement import R, is_shard

DEFAULT_BUCKET_BYTES = 25 * 2**20   # DDP's default: big enough that per-call latency is small next to the bytes


def deferred_axes(cap: Captured, strategies: dict, grad_nodes: set) -> dict:
    """Parameter node -> the mesh axes whose gradient all-reduce the buckets do, ordered by first use.

    An axis qualifies when every use of the weight reads it whole there and gets back a partial sum (a
    data axis: the batch is split): only then is the reduction there one all-reduce of the summed uses,
    which nothing in backward waits for. ZeRO weights are left to their optimizer wrapper, and weights a
    use gathers (FSDP) to the reduction of that gather.
    """
    params = {n for n, info in cap.info.items() if info.kind == PARAM and n in grad_nodes
              and strategies.get(n) is not None and not strategies[n].zero_axes}
    found: dict = {}
    for node in cap.graph.nodes:
        s = strategies.get(node.name)
        if node.op not in ("output", "call_function"):
            continue
        for i, a in enumerate(tensor_args(node)):
            if a.name not in params:
                continue
            ok = set()
            if s is not None and node.op == "call_function":
                src, dst = strategies[a.name].output, s.inputs[i]
                # a weight gathered for its use (FSDP storage) reduce-scatters its gradient in the graph or
                # with its layer (layer_groups.py), which then owns the gradient: its other axes stay there too
                if not any(is_shard(p) and q == R for p, q in zip(src, dst)):
                    ok = {x for x in s.grad_partial(i) if src[x] == R and dst[x] == R}
            found[a.name] = found[a.name] & ok if a.name in found else ok
    return {n: tuple(sorted(axes)) for n, axes in found.items() if axes}


def assign_buckets(entries: list, bucket_bytes: int) -> list:
    """Buckets of `entries` [(name, numel, axes, kind, itemsize)] taken in order (backward's): one list of
    names per bucket, each bucket of one (axes, kind), closed when the next weight would take it past
    `bucket_bytes` (a weight bigger than that gets a bucket of its own). `kind`: what must match to share a
    flat buffer (the reduce dtype)."""
    buckets: list = []
    open_bucket: dict = {}   # (axes, kind) -> [index in buckets, bytes so far]
    for name, n, axes, kind, itemsize in entries:
        key = (tuple(axes), kind)
        cur = open_bucket.get(key)
        if cur is None or (cur[1] and cur[1] + n * itemsize > bucket_bytes):
            cur = open_bucket[key] = [len(buckets), 0]
            buckets.append((tuple(axes), kind, []))
        buckets[cur[0]][2].append(name)
        cur[1] += n * itemsize
    return buckets
