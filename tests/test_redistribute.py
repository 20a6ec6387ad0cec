"""Layout changes, one axis at a time, simulated on plain tensors (no process group).

Every step's forward is checked against cutting the whole tensor into the
target layout, on every simulated rank of a 2x2 mesh, including the nested
cases that need the gather-everything-then-cut fallback.
"""
import itertools

import pytest
import torch

from autopar.sharding.placement import R, S, shard_full_tensor
from autopar.sharding.redistribute import ALL_GATHER, ALL_TO_ALL, CHUNK, NONE, plan_steps

SIZES = (2, 2)
COORDS = list(itertools.product(range(2), range(2)))
LAYOUTS = [(a, b) for a in (R, S(0), S(1)) for b in (R, S(0), S(1))]


def _apply(step, locals_by_rank):
    """Run one forward step on all simulated ranks (the ranks along step.axis exchange data)."""
    out = {}
    for coord in COORDS:
        peers = [tuple(coord[:step.axis]) + (i,) + tuple(coord[step.axis + 1:]) for i in range(2)]
        kind = step.forward_kind
        x = locals_by_rank[coord]
        if kind == NONE:
            out[coord] = x
        elif kind == CHUNK:
            d = int(step.dst[2:-1])
            out[coord] = x.chunk(2, d)[coord[step.axis]]
        elif kind == ALL_GATHER:
            d = int(step.src[2:-1])
            out[coord] = torch.cat([locals_by_rank[p] for p in peers], d)
        elif kind == ALL_TO_ALL:
            d_in, d_out = int(step.src[2:-1]), int(step.dst[2:-1])
            pieces = [locals_by_rank[p].chunk(2, d_out)[coord[step.axis]] for p in peers]
            out[coord] = torch.cat(pieces, d_in)
        else:
            raise AssertionError(kind)
    return out


@pytest.mark.parametrize("src, dst", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_every_split_layout_reaches_every_other(src, dst):
    full = torch.arange(8 * 8.0).reshape(8, 8)
    locals_ = {c: shard_full_tensor(full, src, c, SIZES) for c in COORDS}
    for step in plan_steps(src, dst):
        locals_ = _apply(step, locals_)
    for c in COORDS:
        torch.testing.assert_close(locals_[c], shard_full_tensor(full, dst, c, SIZES), atol=0, rtol=0)


def test_nested_change_of_outer_axis_falls_back_to_gather_then_cut():
    steps = plan_steps((S(1), S(1)), (S(0), S(0)))
    kinds = [s.forward_kind for s in steps]
    assert kinds == [ALL_GATHER, ALL_GATHER, CHUNK, CHUNK]
