"""Cost of a strategy and of an edge, in the terms of cost_models.

One set of functions serves both the search (shapes as example ints, fast)
and the plan's symbolic report (shapes as sympy expressions): they only add,
multiply and divide sizes.

Conventions:
- compute: matmul-like ops cost FLOPs / peak, everything else bytes touched /
  memory bandwidth; forward + backward = 3x forward.
- activations: the storages autograd keeps for backward, each charged to one
  node in that node's layout (activations.py: what each op keeps on the
  target hardware's kernels, views sharing storage, who pays).
- parameters: weight, master copy, gradient and optimizer state, at the
  bytes per element the precision policy and optimizer give (precision.py),
  in each parameter's storage layout (ZeRO splits the last ones).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

import cost_models as cm

from ..capture.export import INPUT, PARAM, Captured, TensorMeta
from ..mesh import MeshSpec
from ..sharding.op_spec import op_arg, op_name, tensor_args
from ..sharding.placement import P, Placements, R, S, ceil_div, local_shape, numel, shard_dim, uneven_dims
from ..sharding.redistribute import (COMMUNICATING, Collective, UnsupportedRedistribution, gathers_again, plan_steps,
                                     int_step_full_bytes, planned_steps, step_collectives)
from ..sharding.rules import causal_rows_split_axes, ring_axes, ring_repeats, vocab_split_axes
from .activations import ActivationModel, activation_model, node_activation_bytes
from .float8 import amax_collectives, float8_linear_seconds, gathers_in_float8, matmul_seconds, runs_float8
from .precision import ParamBytes

MATMUL_OPS = {"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
              "aten.addmm.default"}
SDPA = "aten.scaled_dot_product_attention.default"
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


def first_meta(meta) -> TensorMeta | None:
    return meta[0] if isinstance(meta, list) else meta


def shape_of(meta: TensorMeta, symbolic: bool):
    return meta.shape if symbolic else meta.hint


def saved_outputs(cap: Captured, hardware) -> ActivationModel:
    """What autograd keeps for backward and which node pays for it (see activations.py)."""
    return activation_model(cap, hardware)


def needs_grad(cap: Captured) -> set[str]:
    """Nodes through which a gradient flows back (downstream of a floating parameter the model trains)."""
    out = set()
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        m = first_meta(info.meta)
        floating = m is not None and m.dtype.is_floating_point
        if info.kind == PARAM:
            if floating and info.target_name not in cap.frozen_params:
                out.add(node.name)
        elif node.op == "call_function" and floating and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def node_compute_time(node: fx.Node, cap: Captured, strategy, mesh: MeshSpec, hw: cm.Hardware, symbolic=False,
                      float8=False):
    """Seconds of an op's forward and backward, run eagerly: a matmul at the FLOP/s a step's matmuls reach,
    attention at its own share of the peak, any other op (is_memory_bound) at the memory bandwidth over the
    bytes it reads and writes. (Compiled, predict.py keeps Hardware.compiled_memory_fraction of the last.)
    `float8`: the recipe of a linear the problem runs in float8 (Problem.float8_of; the caller says so, as
    this stage knows no plan), else None: its matmuls at the float8 peak and its casts (float8.float8_linear_seconds), in a
    layout where it can run so (float8.runs_float8)."""
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
        if float8 and runs_float8(strategy, metas[1].hint, sizes):
            pieces = ((numel(locals_[0]), metas[0].itemsize), (numel(locals_[1]), metas[1].itemsize),
                      (numel(out_local), out.itemsize))
            return float8_linear_seconds(flops, pieces, hw, float8)
        return matmul_seconds(flops, dtype, hw)
    if name == SDPA:
        q, kk = locals_[0], locals_[1]
        keys = kk[-2]
        for a in ring_axes(node, strategy, sizes):   # a ring attends to every rank's keys in turn
            keys = keys * sizes[a]
            # its blocks are fp32 matmuls whatever the inputs' dtype (runtime/lowering/ring_attention.py): priced
            # at the preset's float32 rate, as every fp32 matmul is (the presets give TF32's)
            dtype = "float32"
        flops = 2 * numel(q) * keys + 2 * numel(out_local) * keys
        if causal_rows_split_axes(node, strategy, sizes):
            # the causal kernel skips the blocks above the diagonal, about half of them; a rank's rows of a
            # longer sequence run with a mask instead (runtime/lowering/context_parallel.py), every block
            flops *= 2
        return cm.compute_time(cm.TRAIN_FLOPS_FACTOR * flops, dtype, hw) / hw.attention_efficiency
    touched = numel(out_local) * out.itemsize + sum(numel(l) * m.itemsize for l, m in zip(locals_, metas))
    return cm.memory_time(cm.TRAIN_FLOPS_FACTOR * touched, hw)


def is_memory_bound(node: fx.Node) -> bool:
    """Whether node_compute_time prices the op by the bytes it moves (no matmul, no attention)."""
    return op_name(node) not in MATMUL_OPS and op_name(node) != SDPA


def op_collectives(node: fx.Node, cap: Captured, strategy, mesh: MeshSpec, symbolic=False,
                   float8=False) -> list[Collective]:
    """Collectives an op launches inside itself: a cross-entropy over classes split on some axes
    all-reduces a max and then a sum of exponentials, one number per position (fp32 at least), over each
    of them (runtime/lowering/vocab_parallel.py); a ring attention passes keys and values round
    (ring_collectives); a float8 linear (`float8`: its recipe, as node_compute_time's) all-reduces the amax of each
    tensor it casts over the axes that split it (float8.amax_collectives). Every other op launches none."""
    if float8:
        args = tensor_args(node)
        metas = [first_meta(cap.info[a.name].meta) for a in args[:2]]
        if not runs_float8(strategy, metas[1].hint, mesh.axis_sizes):
            return []
        out = first_meta(cap.info[node.name].meta)
        shapes = [local_shape(shape_of(m, symbolic), pl, mesh.axis_sizes)
                  for m, pl in zip(metas + [out], strategy.inputs[:2] + (strategy.output,))]
        return amax_collectives(node, strategy, metas, out, float8, shapes)
    if ring_axes(node, strategy, mesh.axis_sizes):
        return ring_collectives(node, cap, strategy, mesh, symbolic)
    axes = vocab_split_axes(node, strategy, mesh.axis_sizes)
    if not axes:
        return []
    logits, target = (first_meta(cap.info[a.name].meta) for a in tensor_args(node)[:2])
    itemsize = max(logits.itemsize, 4)   # the op computes in fp32 at least
    nbytes = numel(local_shape(shape_of(target, symbolic), strategy.inputs[1], mesh.axis_sizes)) * itemsize
    return [Collective(cm.ALL_REDUCE, a, nbytes, "forward", node.name, node.name) for _ in range(2) for a in axes]


def ring_collectives(node: fx.Node, cap: Captured, strategy, mesh: MeshSpec, symbolic=False) -> list[Collective]:
    """The sends of a ring attention over n ranks (runtime/lowering/ring_attention.py), each a
    point-to-point message of a rank's chunk:
    - forward: its keys and values, n-1 times;
    - backward: keys and values again n-1 times, and their gradient's fp32 accumulator n times (back
      to its owner);
    - causal: half the query's rows out and half the output's back in forward, the output's gradient and
      the query's in backward (the balanced layout). With an odd n the middle rank swaps nothing: these
      are the other ranks' bytes.
    Keys and values repeated per query head (GQA's repeat_kv) go round as one copy of each head."""
    (axis,) = ring_axes(node, strategy, mesh.axis_sizes)
    n = mesh.axis_sizes[axis]
    args = tensor_args(node)
    q, k, v = (first_meta(cap.info[a.name].meta) for a in args[:3])
    out = first_meta(cap.info[node.name].meta)
    local = [local_numel(m, pl, mesh, symbolic) for m, pl in zip((q, k, v), strategy.inputs[:3])]
    repeats = ring_repeats(node, cap, strategy, mesh.axis_sizes)
    local[1:] = [x / repeats if symbolic else x // repeats for x in local[1:]]
    kv = local[1] * k.itemsize + local[2] * v.itemsize
    acc = (local[1] + local[2]) * 4

    def sends(nbytes, phase, times, tensor=node.name):
        return [Collective(cm.SEND_RECV, axis, nbytes, phase, node.name, tensor) for _ in range(times)]
    keys = node.name + RING_KEYS
    colls = sends(kv, "forward", n - 1, keys) + sends(kv, "backward", n - 1, keys) + sends(acc, "backward", n)
    if op_arg(node, 5, "is_causal", False):
        q_half = local[0] * q.itemsize / 2
        out_half = local_numel(out, strategy.output, mesh, symbolic) / 2 * out.itemsize
        swap = node.name + SWAPPED_ROWS
        colls += (sends(q_half, "forward", 1, swap) + sends(out_half, "forward", 1, swap)
                  + sends(out_half, "backward", 1, swap) + sends(q_half, "backward", 1, swap))
    return colls


# what a ring attention's sends move, in a Collective's `tensor` (ring_collectives): the keys and values
# passed on (launched before the step's compute, which hides them: overlap.py), and the swaps of query and
# output rows (the middle rank of an odd axis sends none)
RING_KEYS = ":keys and values"
SWAPPED_ROWS = ":swapped rows"


def skips_swaps(axis_size: int, coord: int) -> bool:
    """Whether the rank at `coord` of a ring attention's axis swaps no rows: with an odd number of ranks,
    the middle one holds a balanced pair of chunks already (runtime/lowering/ring_layout.balanced_chunks)."""
    return axis_size % 2 == 1 and coord == axis_size // 2


def activation_bytes(node_name: str, cap: Captured, output: Placements, mesh: MeshSpec,
                     saved: ActivationModel, symbolic=False, strategy=None):
    """Bytes of kept activations node `node_name` pays for with output placements `output`. `strategy`: the
    node's, for the one op whose inputs' layout changes what it keeps besides its output's: a ring
    attention (ring_saved_correction)."""
    kept = node_activation_bytes(saved, node_name, output, mesh.axis_sizes, symbolic)
    if strategy is not None and cap.info[node_name].kind not in (PARAM, INPUT) \
            and ring_axes(cap.node(node_name), strategy, mesh.axis_sizes):
        kept = kept + ring_saved_correction(cap, cap.node(node_name), strategy, mesh, saved, symbolic)
    return kept


def ring_saved_correction(cap: Captured, node: fx.Node, strategy, mesh: MeshSpec, saved: ActivationModel,
                          symbolic=False):
    """What a ring attention keeps beyond what its output's layout says (the activation model knows an op by
    its output's layout, which a ring shares with attention over keys gathered whole): its keys and values
    are kept as this rank's chunk, not whole; a causal one keeps its output in its own row order too, beside
    the output it returns, and its query rows as a new tensor; a masked one keeps its boolean mask (rows split
    like the query's, one storage for all layers: ActivationModel.ring_masks) where a kernel keeps a copy in
    its own dtype; keys and values whose heads GQA's repeat_kv repeated are kept as a new tensor of one copy
    of each (sharding/rules.ring_repeats) (runtime/lowering/ring_attention.py)."""
    charges = saved.charges.get(node.name)
    if not charges:   # it keeps nothing here: recomputed in backward (checkpointing)
        return 0
    (axis,) = ring_axes(node, strategy, mesh.axis_sizes)
    n = mesh.axis_sizes[axis]
    args = tensor_args(node)
    kv = {a.name for a in args[1:3]}
    repeats = ring_repeats(node, cap, strategy, mesh.axis_sizes)
    extra = 0
    for c in charges:
        one = replace(saved, charges={node.name: (c,)})
        if c.follows == 3 or (repeats > 1 and c.what.split(" kept by ")[0] in kv):
            # the kernel's copy of the mask; keys and values with repeated heads, which the ring keeps as a
            # new tensor of one copy each (added below)
            extra = extra - node_activation_bytes(one, node.name, strategy.output, mesh.axis_sizes, symbolic)
        elif c.what.split(" kept by ")[0] in kv and strategy.output[axis] not in c.cut_by:
            whole = node_activation_bytes(one, node.name, strategy.output, mesh.axis_sizes, symbolic)
            extra = extra - (whole - (whole / n if symbolic else whole // n))
    if repeats > 1:
        for a, pl in zip(args[1:3], strategy.inputs[1:3]):
            m = first_meta(cap.info[a.name].meta)
            local = local_numel(m, pl, mesh, symbolic)
            extra = extra + (local / repeats if symbolic else local // repeats) * m.itemsize
    if node.name in saved.ring_masks:
        # the mask as the ring reads it, its rows split: a view of its maker's storage where that has the mask's
        # shape, else (a mask expanded from a smaller one) the new tensor its layout change makes -- or, where
        # it arrives split with no change, a view of less, which this bounds
        mask = first_meta(cap.info[args[3].name].meta)
        extra = extra + local_numel(mask, strategy.inputs[3], mesh, symbolic) * mask.itemsize
    if op_arg(node, 5, "is_causal", False):
        extra = extra + output_bytes(node.name, cap, strategy.output, mesh, symbolic)
        q = tensor_args(node)[0].name
        if not any(c.what.split(" kept by ")[0] == q for c in charges):
            # its query rows, swapped, are a new tensor; where q's storage is charged to another (a fused
            # projection's, which keys and values keep alive) that one is no stand-in for them
            extra = extra + output_bytes(q, cap, strategy.inputs[0], mesh, symbolic)
    return extra


def gathered_weight_bytes(cap: Captured, producer: str, src: Placements, dst: Placements, mesh: MeshSpec,
                          symbolic=False, itemsize=None):
    """Bytes of a parameter gathered whole on a redistribution (FSDP): it lives while its op runs. `itemsize`:
    bytes an element where it is gathered in another dtype than its own (float8)."""
    if cap.info[producer].kind != PARAM or not any(
            st.forward_kind == cm.ALL_GATHER for st in plan_steps(src, dst)):
        return 0
    meta = first_meta(cap.info[producer].meta)
    return local_numel(meta, dst, mesh, symbolic) * (itemsize or meta.itemsize)


def kept_weight_bytes(cap: Captured, producer: str, consumer: str, index: int, src: Placements, dst: Placements,
                      grad_nodes: set, mesh: MeshSpec, symbolic=False):
    """Bytes a weight gathered whole for an op that keeps it for backward holds from forward to backward
    when the plan does not reshard after forward (the re-gather it saves: regathers); 0 for any other edge."""
    if not regathers(cap, producer, consumer, index, grad_nodes):
        return 0
    return gathered_weight_bytes(cap, producer, src, dst, mesh, symbolic)


def is_saved(prob, name: str) -> bool:
    """Does autograd keep this node's storage for backward (then it is an activation, not transient)?"""
    return name in prob.saved.kept


def output_bytes(node_name: str, cap: Captured, output: Placements, mesh: MeshSpec, symbolic=False):
    """Bytes of a node's output (all pieces of a tuple) on one device, in the given layout."""
    info = cap.info[node_name]
    metas = info.meta if isinstance(info.meta, list) else [info.meta]
    return sum(numel(local_shape(shape_of(m, symbolic), output, mesh.axis_sizes)) * m.itemsize for m in metas)


def read_bytes(node_name: str, positions, cap: Captured, strategy, mesh: MeshSpec, symbolic=False):
    """Bytes on one device of some of a node's tensor inputs (by position), as the node reads them under
    `strategy` -- also the bytes of their gradients, which backward makes in the layout read."""
    args = tensor_args(cap.node(node_name))
    return sum(output_bytes(args[i].name, cap, strategy.inputs[i], mesh, symbolic) for i in positions)


@dataclass(frozen=True)
class ParamMemory:
    params: object      # the weight as ops use it (compute dtype)
    master: object      # the optimizer's higher-precision copy (mixed precision)
    grads: object
    optimizer: object
    update: object = 0  # bytes the optimizer step moves for it


def param_memory(meta: TensorMeta, strategy, mesh: MeshSpec, pb: ParamBytes, symbolic=False) -> ParamMemory:
    """Bytes of one parameter on one device under its storage strategy.

    ZeRO keeps the weight whole but splits the master copy and optimizer
    state (and, at level 2, the gradient) into 1/n flat slices over its axes.
    """
    n = local_numel(meta, strategy.output, mesh, symbolic)
    split = 1
    for a in strategy.zero_axes:
        split *= mesh.axis_sizes[a]
    sliced = ceil_div(n, split)   # the largest slice, padded where split does not divide (placement.py)
    state = sliced if strategy.zero else n
    grads = sliced if strategy.zero >= 2 else n
    return ParamMemory(n * pb.weight, state * pb.master, grads * pb.grad, state * pb.optimizer, state * pb.update)


def local_numel(meta: TensorMeta, placements: Placements, mesh: MeshSpec, symbolic=False):
    return numel(local_shape(shape_of(meta, symbolic), placements, mesh.axis_sizes))


def zero_collectives(param: str, meta: TensorMeta, strategy, mesh: MeshSpec, pb: ParamBytes,
                     symbolic=False) -> list[Collective]:
    """ZeRO's two collectives per parameter per step, on its flat local tensor.

    The gradient is reduce-scattered into this rank's slice (in backward at
    level 2, at the optimizer step at level 1), the slice is updated, and the
    updated weight is all-gathered: the bytes of DDP's one all-reduce.
    """
    if not strategy.zero:
        return []
    flat = (local_numel(meta, strategy.output, mesh, symbolic),)
    whole = tuple(R for _ in mesh.axis_sizes)
    sliced = tuple(S(0) if a in strategy.zero_axes else R for a in range(mesh.num_axes))
    partial = tuple(P if a in strategy.zero_axes else R for a in range(mesh.num_axes))
    reduce_phase = "backward" if strategy.zero >= 2 else "optimizer"
    out = []
    for steps, itemsize, phase in ((plan_steps(partial, sliced), pb.reduce, reduce_phase),
                                   (plan_steps(sliced, whole), pb.weight, "optimizer")):
        for st in steps:  # forward halves only: these run outside autograd
            out += [replace(c, phase=phase) for c in step_collectives(st, flat, itemsize, mesh.axis_sizes, param,
                                                                      tensor=param) if c.phase == "forward"]
    return out


def reduce_itemsize(param_bytes: dict, producer: str):
    """Bytes per element of a parameter's gradient on the network (None: the tensor's own)."""
    pb = param_bytes.get(producer)
    return pb.reduce if pb is not None and pb.reduce else None


def edge_collectives(producer: str, src: Placements, dst: Placements, grad_partial, cap: Captured,
                     mesh: MeshSpec, grad_flows: bool, regather: int, where: str,
                     symbolic=False, keep_partial=(), reduce_itemsize=None,
                     gather_itemsize=None) -> list[Collective]:
    """Collectives on one edge; raises UnsupportedRedistribution if it cannot be done.

    `keep_partial`: a ZeRO parameter's axes, where its gradient is left unreduced.
    `reduce_itemsize`: bytes per element of a parameter's gradient reductions
    (a precision policy may reduce in another dtype than the weight's).
    `gather_itemsize`: bytes per element of a float8-gathered weight's all-gathers, where this change
    gathers it in float8 (Problem.gather_itemsize; float8.gathers_in_float8).
    """
    meta = first_meta(cap.info[producer].meta)
    keep_partial = keep_partial if grad_flows else ()
    if src == dst and not (grad_flows and grad_partial) and not keep_partial:
        return []
    steps = plan_steps(src, dst, grad_partial if grad_flows else (), keep_partial=keep_partial)
    check_uneven_gathered(meta, src, steps, mesh)
    regather = regather if gathers_again(steps, cap.info[producer].kind == PARAM) else 0
    if gather_itemsize and not gathers_in_float8(steps, meta.hint, dst, mesh.axis_sizes):
        gather_itemsize = None
    out = []
    for st in steps:
        for c in step_collectives(st, shape_of(meta, symbolic), meta.itemsize, mesh.axis_sizes, where, regather,
                                  producer):
            if c.phase == "backward" and not grad_flows and not (regather and c.kind == cm.ALL_GATHER):
                continue
            if reduce_itemsize and reduce_itemsize != meta.itemsize and c.phase == "backward" \
                    and c.kind != cm.ALL_GATHER:
                c = replace(c, full_bytes=c.full_bytes * reduce_itemsize / meta.itemsize)
            if gather_itemsize and c.kind == cm.ALL_GATHER:
                c = replace(c, full_bytes=c.full_bytes * gather_itemsize / meta.itemsize)
            out.append(c)
    return out


def edge_seconds(meta: TensorMeta, is_param: bool, src: Placements, dst: Placements, grad_partial, mesh: MeshSpec,
                 links: dict, grad_flows: bool, regather: int, keep_partial=(), reduce_itemsize=None,
                 seconds: dict | None = None, gather_itemsize=None) -> float:
    """float(collectives_time(edge_collectives(...))) at the example's sizes, without listing the collectives.

    The search prices ~100k layout pairs a plan (Llama-3-70B on three axes), where making a Collective per
    step took most of the build; this walks the same steps in the same order and adds the same terms, so
    the figure is the same float (tests/test_edge_seconds.py holds the two to equality). Raises
    UnsupportedRedistribution as edge_collectives does. `seconds`: a dict kept between calls on one mesh and
    links, of each collective's time by (kind, bytes, axis): a deep model's pairs move the same few sizes."""
    keep_partial = tuple(keep_partial) if grad_flows else ()
    if src == dst and not (grad_flows and grad_partial) and not keep_partial:
        return 0.0
    steps = planned_steps(tuple(src), tuple(dst), tuple(grad_partial) if grad_flows else (), keep_partial)
    seconds = {} if seconds is None else seconds

    def time_of(kind, fb, axis):
        key = (kind, type(fb), fb, axis)   # (4 and 4.0 are one key, and need not give one float)
        found = seconds.get(key)
        if found is None:
            found = seconds[key] = cm.collective_time(kind, fb, axis_sizes[axis], links[mesh.axis_names[axis]])
        return found

    check_uneven_gathered(meta, src, steps, mesh)
    regather = regather if gathers_again(steps, is_param) else 0
    shape, itemsize, axis_sizes = tuple(meta.hint), meta.itemsize, tuple(mesh.axis_sizes)
    if gather_itemsize and not gathers_in_float8(steps, shape, dst, axis_sizes):
        gather_itemsize = None
    t = 0
    for st in steps:
        forward, backward = st.forward_kind, st.backward_kind
        fb = None
        if forward in COMMUNICATING:
            fb = int_step_full_bytes(st, shape, itemsize, axis_sizes)
            gathered = fb * gather_itemsize / itemsize if gather_itemsize and forward == cm.ALL_GATHER else fb
            t = t + time_of(forward, gathered, st.axis)
            if forward == cm.ALL_GATHER:
                for _ in range(int(regather)):   # gathered again for backward: counted whatever grad_flows
                    t = t + time_of(cm.ALL_GATHER, gathered, st.axis)
        # (edge_collectives' filter: a backward collective where no gradient flows is dropped, an all-gather
        # on an edge that gathers again kept)
        if backward in COMMUNICATING and (grad_flows or (regather and backward == cm.ALL_GATHER)):
            fb = int_step_full_bytes(st, shape, itemsize, axis_sizes) if fb is None else fb
            if reduce_itemsize and reduce_itemsize != itemsize and backward != cm.ALL_GATHER:
                fb = fb * reduce_itemsize / itemsize
            if gather_itemsize and backward == cm.ALL_GATHER:
                fb = fb * gather_itemsize / itemsize
            t = t + time_of(backward, fb, st.axis)
    return float(t)


def check_uneven_gathered(meta: TensorMeta, src: Placements, steps, mesh: MeshSpec) -> None:
    """A tensor stored split unevenly (a parameter, placement.py) may only be all-gathered, on the
    axes that split it so, before anything else: ops and all-to-alls take even shards only."""
    uneven = {d for d in uneven_dims(meta.hint, src, mesh.axis_sizes)}
    if not uneven:
        return
    axes = {a for a, p in enumerate(src) if shard_dim(p) in uneven}
    for st in steps:
        if st.axis in axes:
            if st.forward_kind != cm.ALL_GATHER:
                break
            axes.discard(st.axis)
    if axes:
        raise UnsupportedRedistribution(f"an uneven split of dim(s) {sorted(uneven)} on axes {sorted(axes)} "
                                        "must be gathered first")


def regathers(cap: Captured, producer: str, consumer: str, index: int, grad_nodes: set,
              saved: ActivationModel | None = None, reshard_weights: bool = True) -> int:
    """How many times this edge gathers again in backward, where it gathers: a weight once when the
    op keeps it (FSDP), unless the plan keeps its weights gathered from forward to backward
    (`reshard_weights` False: FSDP2's reshard_after_forward=False); an activation with a gradient once
    when autograd keeps some tensor of it through this op (`saved`; sequence parallelism: gathers_again
    decides which layout changes qualify) -- once for all the ops that read one gathered activation
    (runtime/lowering/regather.py)."""
    if cap.info[producer].kind != PARAM:
        return int(saved is not None and producer in grad_nodes and saved.saves_through.get((consumer, index), 0) > 0)
    if not reshard_weights:
        return 0
    node = cap.node(consumer)
    needed_by = SAVED_FOR_GRAD_OF.get(op_name(node), {}).get(index)
    if not needed_by:
        return 0
    args = tensor_args(node)
    return int(any(j < len(args) and args[j].name in grad_nodes for j in needed_by))


def regather_saving(cap: Captured, saved: ActivationModel | None, producer: str, consumer: str, index: int, src, dst,
                    grad_partial, mesh: MeshSpec, grad_nodes: set, symbolic=False):
    """Activation bytes an edge changes by when its consumer keeps the activation it gathers as the shard
    (negative, or 0): the consumer is charged its input in the gathered layout (activations.py), and
    the module keeps the producer's layout instead (runtime/lowering/regather.py)."""
    if saved is None or cap.info[producer].kind == PARAM or (consumer, index) not in saved.payers \
            or producer not in grad_nodes:
        return 0
    if src == dst or not gathers_again(plan_steps(src, dst, grad_partial), is_param=False):
        return 0
    meta = first_meta(cap.info[producer].meta)
    return (local_numel(meta, src, mesh, symbolic) - local_numel(meta, dst, mesh, symbolic)) * meta.itemsize


def copied_kept_bytes(cap: Captured, saved: ActivationModel | None, producer: str, consumers, src, dst,
                      grad_partial, mesh: MeshSpec, symbolic=False):
    """Activation bytes a redistribution adds when its output, a new tensor, is kept for backward by one of
    `consumers` (or by an op reading it through views) while the producer's storage is paid for by another
    reader in its own layout: attention's output under Ulysses, kept by the attention and, turned back into a
    sequence split by an all-to-all, by the projection after it. activations.py charges one storage per
    tensor, the owner's; the all-to-all makes a second. (An all-gather's copy is the payer's own, priced in
    the layout it takes it in, or kept as the shard: regather_saving.)"""
    if saved is None or cap.info[producer].kind == PARAM or src == dst:
        return 0
    if not any(ci in saved.also_kept for ci in consumers):
        return 0
    if not any(st.forward_kind == cm.ALL_TO_ALL for st in plan_steps(src, dst, grad_partial)):
        return 0
    meta = first_meta(cap.info[producer].meta)
    return local_numel(meta, dst, mesh, symbolic) * meta.itemsize


def collectives_time(colls, mesh: MeshSpec, links: dict, hints=None):
    """Seconds of `colls`; `hints` (the example's sizes) where their bytes may be symbolic (cm.collective_time)."""
    t = 0
    for c in colls:
        axis = mesh.axis_names[c.axis]
        t = t + cm.collective_time(c.kind, c.full_bytes, mesh.axis_sizes[c.axis], links[axis], hints)
    return t


def collectives_bytes(colls, mesh: MeshSpec) -> dict:
    """Per-device bytes sent, per mesh axis name."""
    out = {a: 0 for a in mesh.axis_names}
    for c in colls:
        out[mesh.axis_names[c.axis]] = out[mesh.axis_names[c.axis]] + cm.bytes_moved(
            c.kind, c.full_bytes, mesh.axis_sizes[c.axis])
    return out

