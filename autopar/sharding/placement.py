"""Placements: how a tensor is laid out over the axes of a device mesh.

A tensor's layout is a tuple with one entry per mesh axis:
  "S(d)" split along tensor dim d over that axis,
  "R"    replicated,
  "P"    partial sums, pending a reduction over that axis.
Strings rather than classes: they are hashable, print as the design notation,
and go into JSON unchanged.

When several axes split the same dim the split is nested in mesh order: the
first such axis takes contiguous chunks, the next splits each chunk again
(the same convention as DTensor), so the local chunk index is row-major over
those axes' coordinates.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

R = "R"
P = "P"

Placements = tuple  # tuple[str, ...], one entry per mesh axis


def S(dim: int) -> str:
    return f"S({dim})"


@functools.cache   # pure, over a handful of strings; the search asks millions of times
def shard_dim(p: str) -> int | None:
    """The tensor dim an "S(d)" entry splits, or None for R / P."""
    return int(p[2:-1]) if p.startswith("S(") else None


def is_shard(p: str) -> bool:
    return p.startswith("S(")


def replicated(num_axes: int) -> Placements:
    return (R,) * num_axes


def dim_factor(placements: Placements, dim: int, axis_sizes: Sequence[int]) -> int:
    """How many pieces tensor dim `dim` is cut into by these placements."""
    f = 1
    for p, n in zip(placements, axis_sizes):
        if shard_dim(p) == dim:
            f *= n
    return f


def local_shape(shape: Sequence, placements: Placements, axis_sizes: Sequence[int]) -> tuple:
    """Shape of one rank's shard. Works on ints and on sympy expressions."""
    factors = _dim_factors(tuple(placements), len(shape), tuple(axis_sizes))
    return tuple(size // f if isinstance(size, int) else size / f for size, f in zip(shape, factors))


@functools.cache   # pure; a few thousand distinct layouts per plan
def _dim_factors(placements: Placements, ndim: int, axis_sizes: tuple) -> tuple:
    return tuple(dim_factor(placements, d, axis_sizes) for d in range(ndim))


def numel(shape: Sequence):
    return math.prod(shape) if shape else 1


def normalize(placements: Placements, ndim: int) -> Placements:
    """Turn negative shard dims into positive ones."""
    out = []
    for p in placements:
        d = shard_dim(p)
        out.append(S(d % ndim) if d is not None and d < 0 else p)
    return tuple(out)


def chunk_index(placements: Placements, dim: int, coords: Sequence[int], axis_sizes: Sequence[int]) -> int:
    """Which chunk of dim `dim` this rank holds (row-major over the axes that split it)."""
    idx = 0
    for p, c, n in zip(placements, coords, axis_sizes):
        if shard_dim(p) == dim:
            idx = idx * n + c
    return idx


def shard_full_tensor(full, placements: Placements, coords: Sequence[int], axis_sizes: Sequence[int]):
    """Cut this rank's local shard out of a full tensor (R and P keep it whole)."""
    t = full
    for d in range(full.dim()):
        f = dim_factor(placements, d, axis_sizes)
        if f > 1:
            t = t.chunk(f, dim=d)[chunk_index(placements, d, coords, axis_sizes)]
    return t


def format_placements(placements: Placements, axis_names: Sequence[str]) -> str:
    """'S(0)@dp R@tp' reads better in a table than a bare tuple."""
    return " ".join(f"{p}@{a}" for p, a in zip(placements, axis_names))
