"""Communication cost of ring collectives, alpha-beta model.

Sizes may be ints or sympy expressions (batch, seq symbols), so the formulas use
only + - * / on them: no float(), max() or branches on sizes. The number of
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


def collective_time(kind, full_bytes, n, link):
    """Seconds for one collective: alpha per ring step plus bytes over bandwidth."""
    _check(kind)
    if n == 1:
        return 0
    link = link.for_kind(kind)
    if kind == SEND_RECV:
        return link.latency + full_bytes / link.bandwidth
    # One alpha per ring step. (A ring all-reduce really takes 2(n-1) steps; we keep
    # the reference alpha*(n-1) for every collective: latency is a small term at the
    # message sizes that matter, and one rule keeps predictions easy to check.)
    return link.latency * (n - 1) + bytes_moved(kind, full_bytes, n) / link.bandwidth
