"""FSDP layer groups as the plan predicts them: the weights gathered (and reduce-scattered) together.

FSDP2 flattens each wrapped layer's parameters and moves them in one
all-gather and one reduce-scatter; one collective per weight pays the
per-call latency a dozen times per layer. autopar groups a weight's FSDP
all-gather with those of the other weights of its layer -- the item of a
numbered module list it sits in (`h.3` for `h.3.attn.q.weight`), the root
otherwise, as FSDP2 is applied to each block and then to the root -- when
the gather is the weight's only layout change (one all-gather forward,
one reduce-scatter backward). The runtime (runtime/layer_groups.py) and the
prediction (`grouped`) call the same functions, so the plan lists the
collectives the module launches.
"""
from __future__ import annotations

from ..sharding.redistribute import ALL_GATHER, REDUCE_SCATTER, Collective

ROOT = ""


def layer_of(fqn: str) -> str:
    """The layer a parameter belongs to: its path up to the last numbered module (`h.3`), else the root."""
    parts = fqn.split(".")
    for i in reversed(range(len(parts) - 1)):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ROOT


def groupable(steps: list) -> bool:
    """A weight's redistribution that joins its layer's group: one step, all-gather forward and
    reduce-scatter backward (FSDP storage used whole on that axis, its gradient partial there)."""
    return len(steps) == 1 and steps[0].forward_kind == ALL_GATHER and steps[0].backward_kind == REDUCE_SCATTER


def group_key(fqn: str, steps: list, dtype) -> tuple:
    """What must match to share one flat collective: layer, axis, the dtype it moves in."""
    return (layer_of(fqn), steps[0].axis, dtype)


def grouped(colls: list, members: dict) -> list:
    """`colls` with the per-weight collectives of grouped weights (members: parameter node -> group key)
    replaced by one per group and phase, each moving every member of the group: the forward all-gather,
    the recompute's, backward's re-gather (one per group when any member is gathered again: the module
    keeps a layer's re-gathered weights until each saved use has read them) and the reduce-scatter."""
    out, phases, size = [], {}, {}
    for c in colls:
        key = members.get(c.tensor)
        if key is None or c.kind not in (ALL_GATHER, REDUCE_SCATTER):
            out.append(c)
            continue
        phases.setdefault((key, c.kind, c.phase), None)
        size[(c.kind, c.tensor)] = c.full_bytes   # gathers move the compute dtype, reductions the reduce dtype
    for key, kind, phase in phases:
        names = [n for n, k in members.items() if k == key and (kind, n) in size]
        out.append(Collective(kind, key[1], sum(size[(kind, n)] for n in names), phase,
                              f"layer {key[0] or 'root'}", ",".join(names)))
    return out
