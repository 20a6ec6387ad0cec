"""Communication cost of collectives, alpha-beta model: rings, and NCCL's tree for all-reduce.

Sizes may be ints or sympy expressions (batch, seq symbols), so the formulas use
only + - * / on them: no float(), max() or branches on sizes (an all-reduce's ring-or-tree choice
is made at the example's sizes: collective_time). The number of
devices n is a mesh axis size, a plain int, so the n == 1 check is fine (and is
simply false for a symbolic n).
"""

from .errors import CostModelError

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
SEND_RECV = "send_recv"
KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, SEND_RECV)


def _check(kind):
    if kind not in KINDS:
        raise CostModelError(f"unknown collective kind {kind!r}; known kinds: {', '.join(KINDS)}")


def bytes_moved(kind, full_bytes, n):
    """Bytes each device sends in a ring collective over n devices.

    `full_bytes` is the whole tensor along this axis (the all-gather output, the
    reduce-scatter input). A ring passes n-1 chunks of B/n each; all-reduce is a
    reduce-scatter then an all-gather. In an all-to-all each device holds B/n and
    keeps one of its n blocks, sending the other n-1 blocks of B/n**2 each.
    """
    _check(kind)
    if n == 1:
        return 0  # nothing to exchange with a single device (one pipeline stage: no send)
    if kind == SEND_RECV:
        return full_bytes  # point-to-point: the whole tensor, once
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        return (n - 1) * full_bytes / n
    if kind == ALL_REDUCE:
        return 2 * (n - 1) * full_bytes / n
    return (n - 1) * full_bytes / n**2  # ALL_TO_ALL


def _tree_steps(n, per_node):
    """Latency steps of NCCL's tree all-reduce over n ranks, `per_node` of them in each node, counted as the
    ring's are (one per hop of one direction: collective_time). NCCL chains the ranks inside a node and runs a
    binary tree between the nodes (src/graph/tuning.cc: 2 x ((ranks per node - 1) + log2(nodes)) hops, up
    and back down), so inside one node the tree has the ring's n-1 steps and never wins."""
    per_node = max(1, min(int(per_node), n))
    nodes = -(-n // per_node)
    return (per_node - 1) + (nodes.bit_length() - 1)   # floor(log2(nodes)): NCCL's log2i


def algorithm_terms(kind, full_bytes, n, per_node=1):
    """((latency steps, bytes over bandwidth), ...) of each algorithm NCCL may run `kind` with: the ring's,
    and for an all-reduce the tree's where it takes fewer steps than the ring (with more bytes, it wins
    nowhere else). collective_time prices the fastest; autopar.calibrate fits measured times to the same."""
    ring = ((n - 1), bytes_moved(kind, full_bytes, n))
    if kind != ALL_REDUCE or n == 1:
        return (ring,)
    steps = _tree_steps(n, per_node)
    # each rank receives and sends the whole buffer once up the tree (reduce) and once down (broadcast),
    # pipelined in chunks: 2B over the bandwidth (NCCL's tree algorithm bandwidth is half its bus bandwidth)
    return (ring, (steps, 2 * full_bytes)) if steps < n - 1 else (ring,)


def collective_time(kind, full_bytes, n, link, hints=None):
    """Seconds for one collective: alpha per step plus bytes over bandwidth, by the fastest algorithm.

    Every kind runs as a ring, alpha x (n-1) + bytes_moved / bandwidth. (A ring all-reduce really takes
    2(n-1) steps; we keep the reference alpha x (n-1) for every collective: latency is a small term at the
    message sizes that matter, and one rule keeps predictions easy to check.) An all-reduce is priced as
    NCCL runs it: by the faster of that ring and NCCL's tree (algorithm_terms), whose up-and-down 2 x depth
    hops count, on the same convention, as depth steps: alpha x depth + 2 x bytes / bandwidth. The tree wins
    for small messages on axes across nodes (a float8 amax on a 128-rank data-parallel axis: 7 steps, not
    127), the ring for large ones. `link.ranks_per_node` shapes the tree (cost_models.axis_links sets it).

    `full_bytes` may be a sympy expression: then an all-reduce takes the algorithm that is faster at the
    example's sizes, `hints` ({symbol: int}; CostModelError without them), and its expression, so a
    symbolic time stays a sum of sizes and latencies (whatif reads it as linear in the batch) and equals
    the numeric one at the example.
    """
    _check(kind)
    if n == 1:
        return 0
    per_node = link.ranks_per_node
    link = link.for_kind(kind)
    if kind == SEND_RECV:
        return link.latency + full_bytes / link.bandwidth
    terms = algorithm_terms(kind, full_bytes, n, per_node)
    times = [link.latency * steps + moved / link.bandwidth for steps, moved in terms]
    if len(times) == 1:
        return times[0]
    if isinstance(full_bytes, (int, float)):
        return min(times)
    at = [t.xreplace(hints) if hints is not None and hasattr(t, "xreplace") else t for t in times]
    if any(getattr(t, "free_symbols", None) for t in at):
        raise CostModelError(f"an all-reduce of {full_bytes} bytes needs the example's sizes (hints) to pick "
                             "its algorithm, ring or tree")
    return times[min(range(len(at)), key=lambda i: float(at[i]))]
