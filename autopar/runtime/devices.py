"""Where this rank computes: the device of its mesh, and the local graphs moved onto it."""
from __future__ import annotations

import torch
import torch.fx as fx


def mesh_device(device_mesh) -> torch.device | None:
    """The device this rank computes on: the mesh's type (this process's current CUDA device on "cuda")."""
    if device_mesh is None:
        return None
    device = torch.device(device_mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on_mesh_device(graphs, device_mesh) -> None:
    """Move each graph (None: skipped) onto the mesh's device."""
    device = mesh_device(device_mesh)
    for graph in graphs:
        if graph is not None and device is not None:
            on_device(graph, device)


def on_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Every device the graph names (`torch.arange(T, device=idx.device)` traced on the CPU, or on meta for
    a model built there) made `device`, in the graph and the subgraphs of its higher-order ops: the module
    computes where its mesh is, whatever device the example inputs were on."""
    def retarget(a):
        return device if isinstance(a, torch.device) and a != device else a

    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, retarget)
                node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
            module.recompile()
