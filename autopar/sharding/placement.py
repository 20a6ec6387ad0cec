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

A split need not divide: like torch.chunk, FSDP2 and DTensor, each of n
pieces is ceil(size / n) long and the last ones are shorter or empty
(`chunk_span`). Memory is then priced at the largest piece, and collectives
move padded buffers. Only a parameter's storage is ever split unevenly, on
a dim that one axis alone splits (`uneven_dims`); ops always see even
shards, because a parameter split unevenly is gathered before use.
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
    """Shape of the largest rank's shard (ceil where a split does not divide). Works on ints and on
    sympy expressions (a symbolic size is only ever split evenly: it is divided)."""
    if all(type(size) is int for size in shape):
        return _local_int_shape(tuple(shape), tuple(placements), tuple(axis_sizes))
    factors = _dim_factors(tuple(placements), len(shape), tuple(axis_sizes))
    return tuple(ceil_div(size, f) for size, f in zip(shape, factors))


@functools.lru_cache(maxsize=1 << 16)   # the search asks the same shapes and layouts of every layer
def _local_int_shape(shape: tuple, placements: tuple, axis_sizes: tuple) -> tuple:
    factors = _dim_factors(placements, len(shape), axis_sizes)
    return tuple(-(-size // f) for size, f in zip(shape, factors))


def ceil_div(size, f: int):
    """size / f rounded up (the largest of f pieces); a symbolic size is divided."""
    if isinstance(size, int):
        return -(-size // f)
    if getattr(size, "is_Integer", False):   # a sympy number
        import sympy
        return sympy.Integer(-(-int(size) // f))
    return size / f


def chunk_span(size: int, pieces: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` of `pieces` along a dim of `size`, in torch.chunk's layout:
    every piece ceil(size / pieces) long, the last ones shorter or empty (e.g. 5 over 4: 2, 2, 1, 0)."""
    step = -(-size // pieces)
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def uneven_dims(shape: Sequence[int], placements: Placements, axis_sizes: Sequence[int]) -> list[int]:
    """The dims these placements split into pieces of unequal length."""
    return list(_uneven_dims(tuple(shape), tuple(placements), tuple(axis_sizes)))


@functools.lru_cache(maxsize=1 << 16)   # the search checks every layout pair of every edge
def _uneven_dims(shape: tuple, placements: tuple, axis_sizes: tuple) -> tuple:
    return tuple(d for d, size in enumerate(shape) if size % dim_factor(placements, d, axis_sizes))


def can_split_unevenly(shape: Sequence[int], placements: Placements, axis_sizes: Sequence[int]) -> bool:
    """A dim split unevenly must be split by one axis alone: nested uneven splits (chunks of chunks)
    lay out differently from one chunk of the product, and nothing here needs them."""
    for d in uneven_dims(shape, placements, axis_sizes):
        if sum(1 for p in placements if shard_dim(p) == d) > 1:
            return False
    return True


def gathered_size(shape: Sequence[int], placements: Placements, axis: int, axis_sizes: Sequence[int]) -> int | None:
    """The length of the dim `axis` splits once that axis is gathered (None if it splits none)."""
    d = shard_dim(placements[axis])
    if d is None:
        return None
    whole = placements[:axis] + (R,) + placements[axis + 1:]
    return local_shape(shape, whole, axis_sizes)[d]


@functools.cache   # pure; a few thousand distinct layouts per plan
def _dim_factors(placements: Placements, ndim: int, axis_sizes: tuple) -> tuple:
    return tuple(dim_factor(placements, d, axis_sizes) for d in range(ndim))


def numel(shape: Sequence):
    return math.prod(shape) if shape else 1


def chunk_index(placements: Placements, dim: int, coords: Sequence[int], axis_sizes: Sequence[int]) -> int:
    """Which chunk of dim `dim` this rank holds (row-major over the axes that split it)."""
    idx = 0
    for p, c, n in zip(placements, coords, axis_sizes):
        if shard_dim(p) == dim:
            idx = idx * n + c
    return idx


def shard_full_tensor(full, placements: Placements, coords: Sequence[int], axis_sizes: Sequence[int]):
    """Cut this rank's local shard out of a full tensor (R and P keep it whole); a view.

    torch.chunk's layout: where the split does not divide, the last shards are shorter or empty."""
    t = full
    for d in range(full.dim()):
        f = dim_factor(placements, d, axis_sizes)
        if f > 1:
            start, length = chunk_span(full.shape[d], f, chunk_index(placements, d, coords, axis_sizes))
            t = t.narrow(d, start, length)
    return t


def format_placements(placements: Placements, axis_names: Sequence[str]) -> str:
    """'S(0)@dp R@tp' reads better in a table than a bare tuple."""
    return " ".join(f"{p}@{a}" for p, a in zip(placements, axis_names))
