"""FSDP layer groups as the plan predicts them: the weights gathered (and reduce-scattered) together.

FSDP2 flattens each wrapped layer's parameters and moves them in one
all-gather and one reduce-scatter; one collective per weight pays the
per-call latency a dozen times per layer. autopar groups a weight's FSDP
all-gather with those of the other weights of its layer -- the item of a
numbered module list it sits in (`h.3` for `h.3.attn.q.weight`), the root
otherwise, as FSDP2 is applied to each block and then to the root -- when
the gather is the weight's only layout change (one all-gather forward,
one reduce-scatter backward) apart from gradient sums on other axes (a
norm weight whose input is split along the sequence over tp gets partial
gradients there): the group all-reduces its reduce-scattered shard over
those axes, one collective per layer instead of one per weight, on 1/n of
the bytes. The plan's schedule (planning/schedule.py, which the runtime's
runtime/reduction/layer_groups.py runs) and the prediction (`grouped`) call
the same functions, so the plan lists the collectives the module launches.
"""
from __future__ import annotations

from ..sharding.redistribute import ALL_GATHER, ALL_REDUCE, CHUNK, NONE, REDUCE_SCATTER, ZERO, Collective

ROOT = ""


def layer_of(fqn: str) -> str:
    """The layer a parameter belongs to: its path up to the last numbered module (`h.3`), else the root."""
    parts = fqn.split(".")
    for i in reversed(range(len(parts) - 1)):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ROOT


def groupable(steps: list) -> bool:
    """A weight's redistribution that joins its layer's group: first a step that all-gathers forward and
    reduce-scatters backward (FSDP storage used whole on that axis, its gradient partial there), then
    only steps that sum the gradient on other axes (nothing forward, an all-reduce backward: the group
    does it) or that cut the gathered weight locally (a chunk, or a row-parallel bias kept on one rank:
    no communication either way; the module applies them to what the group serves)."""
    return (bool(steps) and steps[0].forward_kind == ALL_GATHER and steps[0].backward_kind == REDUCE_SCATTER
            and all(sums_gradient(s) or (s.forward_kind in (ZERO, CHUNK) and s.backward_kind == NONE)
                    for s in steps[1:]))


def gathers_float8(steps: list) -> bool:
    """A weight's redistribution whose gather can move float8 (a float8 linear's weight, torchao's
    enable_fsdp_float8_all_gather): one that joins its layer's group and hands the op the gathered weight as
    is (no local cut after the gather; sums of the gradient on other axes are the group's, after it)."""
    return groupable(steps) and all(s.forward_kind == NONE for s in steps[1:])


def sums_gradient(step) -> bool:
    """A step that only sums the gradient on its axis (a grouped weight's: its group all-reduces the shard)."""
    return step.forward_kind == NONE and step.backward_kind == ALL_REDUCE


def group_key(fqn: str, steps: list, dtype) -> tuple:
    """What must match to share one flat collective: layer, gather axis, the dtype it moves in, and the
    axes its reduce-scattered gradient is summed over afterwards."""
    return (layer_of(fqn), steps[0].axis, dtype, tuple(sorted(s.axis for s in steps[1:] if sums_gradient(s))))


def alive_spans(uses: dict) -> dict:
    """{group: (first, last) forward op index while its weights are gathered}, from {group: [indices of the
    ops that read them]}: as the module runs them (runtime/reduction/layer_groups.py), a group's weights arrive in one
    gather at the first use of any of them, which also launches the next group's (the prefetch), and stay
    until the last has been used; so group k lives from group k-1's first use (its own, for the first) to
    its own last use, and the root group (embeddings, head: first and last) through the whole forward."""
    order = sorted(((min(u), max(u), g) for g, u in uses.items() if u), key=lambda t: t[:2])
    return {g: (order[k - 1][0] if k else first, last) for k, (first, last, g) in enumerate(order)}


def grouped(colls: list, members: dict, axis_sizes) -> list:
    """`colls` with the per-weight collectives of grouped weights (members: parameter node -> group key)
    replaced by one per group and phase, each moving every member of the group: the forward all-gather,
    the recompute's, backward's re-gather (one per group when any member is gathered again: the module
    keeps a layer's re-gathered weights until each saved use has read them), the reduce-scatter, and
    after it an all-reduce of its output (1/n of its input) on each axis the gradient is summed over."""
    out, phases, size = [], {}, {}
    for c in colls:
        key = members.get(c.tensor)
        if key is None or not (c.kind in (ALL_GATHER, REDUCE_SCATTER) or
                               (c.kind == ALL_REDUCE and c.phase == "backward" and c.axis in key[3])):
            out.append(c)
            continue
        if c.kind != ALL_REDUCE:   # the group's sums follow its reduce-scatter: priced below
            phases.setdefault((key, c.kind, c.phase), None)
            size[(c.kind, c.tensor)] = c.full_bytes   # gathers move the compute dtype, reductions the reduce dtype
    for key, kind, phase in phases:
        names = [n for n, k in members.items() if k == key and (kind, n) in size]
        where, total = f"layer {key[0] or 'root'}", sum(size[(kind, n)] for n in names)
        out.append(Collective(kind, key[1], total, phase, where, ",".join(names)))
        if kind == REDUCE_SCATTER:
            out += [Collective(ALL_REDUCE, a, total // axis_sizes[key[1]], phase, where, ",".join(names))
                    for a in key[3]]
    return out
