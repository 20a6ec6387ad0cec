"""Cost of a strategy and of an edge, in the terms of cost_models.

One set of functions serves both the search (shapes as example ints, fast)
and the plan's symbolic report (shapes as sympy expressions): they only add,
multiply and divide sizes.

Conventions (issue-2 model; the activation model is refined later):
- compute: matmul-like ops cost FLOPs / peak, everything else bytes touched /
  memory bandwidth; forward + backward = 3x forward.
- activations: a node's output counts once if some consumer saves it for
  backward (attributed to the producer, so a tensor saved by three ops is
  counted once), in the producer's own layout.
- parameters: fp32 weights + fp32 grads + AdamW's two fp32 moments,
  in each parameter's storage layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import cost_models as cm
import torch.fx as fx

from .capture import BUFFER, INPUT, PARAM, Captured, TensorMeta
from .mesh import MeshSpec
from .placement import Placements, local_shape, numel
from .redistribute import Collective, plan_steps, step_collectives
from .rules import op_name, tensor_args

MATMUL_OPS = {"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
              "aten.addmm.default"}
SDPA = "aten.scaled_dot_product_attention.default"
# inputs each op keeps for backward (by position among its tensor inputs); "out" = its own output
SAVES = {
    "aten.linear.default": (0,), "aten.matmul.default": (0, 1), "aten.mm.default": (0, 1),
    "aten.bmm.default": (0, 1), "aten.addmm.default": (1, 2), "aten.layer_norm.default": (0,),
    "aten.gelu.default": (0,), "aten.silu.default": (0,), "aten.relu.default": ("out",),
    "aten.tanh.default": ("out",), "aten.sigmoid.default": ("out",), "aten.exp.default": ("out",),
    "aten.softmax.int": ("out",), "aten._softmax.default": ("out",), "aten.log_softmax.int": ("out",),
    "aten.mul.Tensor": (0, 1), "aten.div.Tensor": (0, 1), "aten.rsqrt.default": ("out",),
    "aten.pow.Tensor_Scalar": (0,), SDPA: (0, 1, 2, "out"),
}
# ops that keep a weight input to compute the gradient of their other inputs: under FSDP
# the gathered weight is dropped after forward and gathered again when backward needs it
# op -> {tensor input i: inputs whose gradient needs input i}: autograd keeps input i for
# backward iff one of those needs a gradient (measured with saved_tensors_hooks on torch 2.13)
SAVED_FOR_GRAD_OF = {
    "aten.linear.default": {1: (0,)},
    "aten.matmul.default": {0: (1,), 1: (0,)}, "aten.mm.default": {0: (1,), 1: (0,)},
    "aten.bmm.default": {0: (1,), 1: (0,)}, "aten.addmm.default": {1: (2,), 2: (1,)},
    "aten.layer_norm.default": {1: (0, 1, 2), 2: (0, 1, 2)},  # kept whenever anything needs grad
    "aten.mul.Tensor": {0: (1,), 1: (0,)}, "aten.div.Tensor": {0: (1,), 1: (0, 1)},
}
OPTIMIZER_STATES_PER_PARAM = 2  # AdamW: exp_avg and exp_avg_sq


def first_meta(meta) -> TensorMeta | None:
    return meta[0] if isinstance(meta, list) else meta


def shape_of(meta: TensorMeta, symbolic: bool):
    return meta.shape if symbolic else meta.hint


def saved_outputs(cap: Captured) -> set[str]:
    """Names of nodes whose output some op keeps for backward."""
    saved = set()
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        keep = SAVES.get(op_name(node), ())
        args = tensor_args(node)
        for k in keep:
            if k == "out":
                saved.add(node.name)
            elif k < len(args):
                saved.add(args[k].name)
    return {n for n in saved if cap.info[n].kind not in (PARAM, BUFFER, INPUT)}


def needs_grad(cap: Captured) -> set[str]:
    """Nodes through which a gradient flows back (downstream of a floating parameter)."""
    out = set()
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        m = first_meta(info.meta)
        floating = m is not None and m.dtype.is_floating_point
        if info.kind == PARAM:
            if floating:
                out.add(node.name)
        elif node.op == "call_function" and floating and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def node_compute_time(node: fx.Node, cap: Captured, strategy, mesh: MeshSpec, hw: cm.Hardware, symbolic=False):
    info = cap.info[node.name]
    out = first_meta(info.meta)
    if node.op != "call_function" or out is None:
        return 0
    sizes = mesh.axis_sizes
    out_local = local_shape(shape_of(out, symbolic), strategy.output, sizes)
    name = op_name(node)
    args = tensor_args(node)
    metas = [first_meta(cap.info[a.name].meta) for a in args]
    locals_ = [local_shape(shape_of(m, symbolic), pl, sizes) for m, pl in zip(metas, strategy.inputs)]
    dtype = str(out.dtype).replace("torch.", "")
    if name in MATMUL_OPS and len(locals_) >= 2:
        k = locals_[1][-1] if name == "aten.addmm.default" else locals_[0][-1]
        flops = 2 * numel(out_local) * k
        return cm.compute_time(cm.TRAIN_FLOPS_FACTOR * flops, dtype, hw)
    if name == SDPA:
        q, kk = locals_[0], locals_[1]
        flops = 2 * numel(q) * kk[-2] + 2 * numel(out_local) * kk[-2]
        return cm.compute_time(cm.TRAIN_FLOPS_FACTOR * flops, dtype, hw)
    touched = numel(out_local) * out.itemsize + sum(numel(l) * m.itemsize for l, m in zip(locals_, metas))
    return cm.memory_time(cm.TRAIN_FLOPS_FACTOR * touched, hw)


def activation_bytes(node_name: str, cap: Captured, output: Placements, mesh: MeshSpec, saved: set, symbolic=False):
    if node_name not in saved:
        return 0
    info = cap.info[node_name]
    metas = info.meta if isinstance(info.meta, list) else [info.meta]
    return sum(numel(local_shape(shape_of(m, symbolic), output, mesh.axis_sizes)) * m.itemsize for m in metas)


@dataclass(frozen=True)
class ParamMemory:
    params: object
    grads: object
    optimizer: object


def param_memory(meta: TensorMeta, storage: Placements, mesh: MeshSpec, trainable=True, symbolic=False) -> ParamMemory:
    b = numel(local_shape(shape_of(meta, symbolic), storage, mesh.axis_sizes)) * meta.itemsize
    if not trainable:
        return ParamMemory(b, 0, 0)
    return ParamMemory(b, b, OPTIMIZER_STATES_PER_PARAM * b)


def edge_collectives(producer: str, src: Placements, dst: Placements, grad_partial, cap: Captured,
                     mesh: MeshSpec, grad_flows: bool, regather: bool, where: str,
                     symbolic=False) -> list[Collective]:
    """Collectives on one edge; raises UnsupportedRedistribution if it cannot be done."""
    meta = first_meta(cap.info[producer].meta)
    if src == dst and not (grad_flows and grad_partial):
        return []
    steps = plan_steps(src, dst, grad_partial if grad_flows else ())
    out = []
    for st in steps:
        for c in step_collectives(st, shape_of(meta, symbolic), meta.itemsize, mesh.axis_sizes, where, regather,
                                  producer):
            if c.phase == "backward" and not grad_flows and not (regather and c.kind == cm.ALL_GATHER):
                continue
            out.append(c)
    return out


def regathers(cap: Captured, producer: str, consumer: str, index: int, grad_nodes: set) -> bool:
    """Does this parameter edge gather again in backward (autograd keeps the weight)?"""
    if cap.info[producer].kind != PARAM:
        return False
    node = cap.node(consumer)
    needed_by = SAVED_FOR_GRAD_OF.get(op_name(node), {}).get(index)
    if not needed_by:
        return False
    args = tensor_args(node)
    return any(j < len(args) and args[j].name in grad_nodes for j in needed_by)


def collectives_time(colls, mesh: MeshSpec, links: dict):
    t = 0
    for c in colls:
        axis = mesh.axis_names[c.axis]
        t = t + cm.collective_time(c.kind, c.full_bytes, mesh.axis_sizes[c.axis], links[axis])
    return t


def collectives_bytes(colls, mesh: MeshSpec) -> dict:
    """Per-device bytes sent, per mesh axis name."""
    out = {a: 0 for a in mesh.axis_names}
    for c in colls:
        out[mesh.axis_names[c.axis]] = out[mesh.axis_names[c.axis]] + cm.bytes_moved(
            c.kind, c.full_bytes, mesh.axis_sizes[c.axis])
    return out

