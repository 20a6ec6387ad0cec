"""The mesh as autopar sees it: named axes and their sizes, nothing else.

Planning needs only names and sizes, so `autopar.plan` works offline from a
mapping like {"dp": 32, "tp": 8}; running needs the torch DeviceMesh too,
which `parallelize` keeps beside this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from .errors import MeshError


@dataclass(frozen=True)
class MeshSpec:
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @property
    def num_axes(self) -> int:
        return len(self.axis_names)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    def axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise MeshError(f"mesh has no axis {name!r}; its axes are {list(self.axis_names)}")
        return self.axis_names.index(name)

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes))


def mesh_spec(mesh) -> MeshSpec:
    """A MeshSpec from a torch DeviceMesh or a mapping {axis_name: size}."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh.keys()), tuple(mesh.values())
    elif hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "shape"):
        sizes = tuple(int(s) for s in mesh.shape)
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else tuple(
            f"axis{i}" for i in range(len(sizes)))
    else:
        raise MeshError(
            f"mesh must be a torch DeviceMesh or a mapping like {{'dp': 2, 'tp': 4}}, got {type(mesh).__name__}")
    if not names:
        raise MeshError("mesh has no axes; give at least one, e.g. {'dp': 2}")
    for n, s in zip(names, sizes):
        if not isinstance(n, str) or not n:
            raise MeshError(f"mesh axis names must be non-empty strings, got {n!r}")
        if not isinstance(s, int) or s < 1:
            raise MeshError(f"mesh axis {n!r} has size {s!r}; sizes must be positive integers")
    if len(set(names)) != len(names):
        raise MeshError(f"mesh axis names must be distinct, got {list(names)}")
    return MeshSpec(names, sizes)
