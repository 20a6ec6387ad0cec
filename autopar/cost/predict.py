"""Predictions for a chosen set of strategies: numbers and sympy expressions.

The redistributions listed here are grouped exactly as the rewriter inserts
them (one per producer, target layout and gradient layout), so the bytes a
plan predicts are the bytes the module moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

import sympy

import cost_models as cm

from ..capture.blocks import block_nodes
from ..capture.export import BUFFER, INPUT, OP, PARAM
from ..sharding.placement import is_shard, local_shape, numel
from ..sharding.redistribute import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Collective, gathers_again, plan_steps
from .buckets import assign_buckets, graph_uses, params_by_first_use, partial_gradients, zero_buckets
from .checkpointing import recomputed_ops, rerun_blocks, rerun_ops, stacks_of
from .float8 import (float8_gather_amaxes, gathers_in_float8, runs_float8, shared_input_scales,
                     shared_scale_amaxes)
from .layer_groups import alive_spans, group_key, groupable, grouped
from .overlap import BUCKET, hidden_comm_time
from .problem import charge_key, checkpoint_model, edge_regathers, reshards
from .terms import (activation_bytes, copied_kept_bytes, edge_collectives, first_meta, gathered_weight_bytes,
                    is_memory_bound, is_saved, kept_weight_bytes, node_compute_time, op_collectives, output_bytes,
                    param_memory, read_bytes, reduce_itemsize, regather_saving, zero_collectives)


@dataclass(frozen=True)
class Redistribution:
    """One redistribution the rewriter inserts: producer -> layout for some consumers."""
    producer: str
    src: tuple
    dst: tuple
    grad_partial: tuple
    consumers: tuple       # (consumer node, tensor input index) pairs it feeds
    regather_count: int    # consumers that gather the (FSDP) weight again in backward
    keep_partial: tuple = ()  # a ZeRO parameter's axes: its gradient stays unreduced there


def group_redistributions(prob, choice) -> list[Redistribution]:
    groups: dict = {}
    strategies, grad_nodes = prob.strategies, prob.grad_nodes
    partial: dict = {}   # (id of the consumer's strategy, input index) -> grad_partial: repeats share strategies
    # each edge's terms.regathers under this problem's choices, kept between predictions (nothing it reads changes)
    regathers = prob.node_cost_cache.setdefault(("edge regathers", id(prob.saved), bool(prob.regather_activations),
                                                 reshards(prob)), {})
    for e in prob.edges:
        u = strategies[e.producer].strategies[choice[e.producer]]
        v = strategies[e.consumer].strategies[choice[e.consumer]]
        src, dst = u.output, v.inputs[e.index]
        if e.producer in grad_nodes:
            gp = partial.get((id(v), e.index))
            if gp is None:
                gp = partial[(id(v), e.index)] = v.grad_partial(e.index)
            keep = u.zero_axes
        else:
            gp = keep = ()
        if src == dst and not gp and not keep:
            continue
        key = (e.producer, dst, gp)
        g = groups.setdefault(key, [src, [], 0, keep])
        g[1].append((e.consumer, e.index))
        n = regathers.get((e.producer, e.consumer, e.index))
        if n is None:
            n = regathers[(e.producer, e.consumer, e.index)] = int(edge_regathers(prob, e))
        g[2] += n
    # an activation is gathered again once for all its readers (runtime/lowering/regather.py), a weight per reader
    return [Redistribution(p, tuple(g[0]), tuple(d), tuple(gp), tuple(g[1]),
                           g[2] if prob.cap.info[p].kind == PARAM else min(g[2], 1), tuple(g[3]))
            for (p, d, gp), g in groups.items()]


def redistribution_collectives(prob, r: Redistribution, symbolic=False, memo: dict | None = None) -> list[Collective]:
    """`memo`: a dict shared by calls on one problem (the same cap and mesh): a repeated block's
    redistributions move the same bytes, so their collectives are made once and relabelled."""
    where = r.consumers[0][0]
    if memo is None:
        found = _redistribution_collectives(prob, r, symbolic)
    else:
        info = prob.cap.info[r.producer]
        meta = first_meta(info.meta)
        key = (id(prob.cap), prob.mesh.axis_sizes, meta.shape, meta.hint, meta.dtype, info.kind == PARAM,
               r.producer in prob.grad_nodes, reduce_itemsize(prob.param_bytes, r.producer),
               prob.gather_itemsize(r.producer), r.src, r.dst,
               r.grad_partial, r.keep_partial, r.regather_count, symbolic)
        found = memo.get(key)
        if found is None:
            found = memo[key] = _redistribution_collectives(prob, r, symbolic)
    return [Collective(kind, axis, full_bytes, phase, where, r.producer) for kind, axis, full_bytes, phase in found]


def _redistribution_collectives(prob, r: Redistribution, symbolic) -> list[tuple]:
    """redistribution_collectives' (kind, axis, full_bytes, phase), without their labels."""
    where = r.consumers[0][0]
    colls = edge_collectives(r.producer, r.src, r.dst, r.grad_partial, prob.cap, prob.mesh,
                             r.producer in prob.grad_nodes, False, where, symbolic,
                             keep_partial=r.keep_partial, reduce_itemsize=reduce_itemsize(prob.param_bytes, r.producer),
                             gather_itemsize=prob.gather_itemsize(r.producer))
    steps = plan_steps(r.src, r.dst, r.grad_partial if r.producer in prob.grad_nodes else (),
                       keep_partial=r.keep_partial)
    again = gathers_again(steps, prob.cap.info[r.producer].kind == PARAM)
    regather = [c for c in colls if c.phase == "forward" and c.kind == ALL_GATHER and again]
    for _ in range(r.regather_count):
        colls += [Collective(ALL_GATHER, c.axis, c.full_bytes, "backward", where, r.producer)
                  for c in regather]
    return [(c.kind, c.axis, c.full_bytes, c.phase) for c in colls]


@dataclass(frozen=True)
class Memory:
    params: object        # weights as the ops use them, and buffers
    grads: object
    optimizer: object
    activations: object
    transient: object
    total: object
    master: object = 0    # mixed precision: the optimizer's fp32 copy of the weights


@dataclass(frozen=True)
class Predicted:
    """Per device, per training step. Numbers (bytes, seconds) or sympy expressions."""
    memory: Memory
    comm_bytes: dict      # axis name -> bytes sent per device per step
    comm_time: dict       # axis name -> seconds
    compute_time: object
    step_time: object
    comm_bytes_by_kind: dict = field(default_factory=dict)  # collective kind -> bytes
    # axis name -> seconds of comm_time the step waits for (overlap.py); the rest hides behind compute
    exposed_comm_time: dict = field(default_factory=dict)
    # the optimizer step: the bytes its elementwise kernels move (precision.OptimizerSpec) over memory
    # bandwidth; step_time = compute_time + optimizer_time + the exposed communication
    optimizer_time: object = 0
    # step_time under torch.compile: the memory-bound ops' time scaled by the hardware's
    # compiled_memory_fraction (inductor fuses them); the optimizer runs outside the compiled module
    compiled_step_time: object = 0
    # where that saving comes from (COMPILE_REGIONS -> seconds; step_time - compiled_step_time in all): a job
    # that compiles only part of the model, as torchtitan compiles each transformer block, saves its regions'
    fused_time: dict = field(default_factory=dict)

    @property
    def hidden_comm_time(self) -> dict:
        return {a: t - self.exposed_comm_time.get(a, t) for a, t in self.comm_time.items()}


def predict(prob, choice, symbolic: bool, checkpointed=None) -> tuple[Predicted, list[Collective]]:
    """`checkpointed`: {path: kind} of the stacks (prob.stacks) whose blocks, or their attention cores,
    recompute in backward."""
    mesh = prob.mesh
    num = (lambda x: x) if symbolic else (lambda x: float(x))
    stacks = stacks_of(prob.stacks, checkpointed or {})
    saved = checkpoint_model(prob, tuple(st.key for st in stacks)) if stacks else prob.saved
    # ops whose forward runs again, and the ops the rerun passes (a per-op checkpoint's cached ones too)
    rerun = set().union(*(recomputed_ops(st, prob.saved) for st in stacks))
    passed = set().union(*(rerun_ops(st, prob.saved) for st in stacks))
    params, master, grads, opt, update, colls = _state_terms(prob, choice, symbolic)
    optimizer_time = cm.optimizer_time(update, prob.hardware)
    acts, compute, memory_bound, op_times = _op_terms(prob, choice, symbolic, saved, rerun)
    groups = group_redistributions(prob, choice)
    kept = saved if prob.regather_activations else None   # the model the re-gather saving reads
    acts = acts + sum(regather_saving(prob.cap, kept, r.producer, c, i, r.src, r.dst, r.grad_partial, mesh,
                                      prob.grad_nodes, symbolic) for r in groups for c, i in r.consumers)
    acts = acts + sum(copied_kept_bytes(prob.cap, saved, r.producer, r.consumers, r.src, r.dst, r.grad_partial, mesh,
                                        symbolic) for r in groups)
    acts = acts + _kept_weights(prob, groups, stacks, symbolic)
    colls = zero_bucketed(prob, choice, colls) + _redistributions(prob, groups, stacks, passed, symbolic)
    colls = bucketed(prob, choice, colls + _op_collectives(prob, choice, rerun, symbolic, passed))
    members = layer_members(prob, groups)
    colls = grouped(colls, members, prob.mesh.axis_sizes)
    colls = float8_gather_amaxes(colls, members, float8_gathers(prob, groups, members))
    transient = transient_bytes(prob, choice, groups, stacks, symbolic, zero_bucket_hold(colls))
    comm_bytes, comm_time, by_kind = _comm_terms(colls, mesh, prob.links, prob.cap.hints)
    hidden = hidden_comm_time(prob, colls, op_times, rerun)
    exposed = {a: comm_time[a] - hidden[a] for a in comm_time}
    total_mem = params + master + grads + opt + acts + transient
    mem = Memory(num(params), num(grads), num(opt), num(acts), num(transient), num(total_mem), num(master))
    step = compute + optimizer_time + sum(exposed.values())
    fused = {region: (1 - prob.hardware.compiled_memory_fraction) * t for region, t in memory_bound.items()}
    pred = Predicted(mem, {a: num(v) for a, v in comm_bytes.items()}, {a: num(v) for a, v in comm_time.items()},
                     num(compute), num(step), {k: num(v) for k, v in by_kind.items()},
                     {a: num(v) for a, v in exposed.items()}, num(optimizer_time), num(step - sum(fused.values())),
                     {region: num(t) for region, t in fused.items()})
    return pred, colls


def layer_members(prob, groups: list) -> dict:
    """Parameter node -> its FSDP layer group (layer_groups.py), for the weights the rewriter groups."""
    if prob.pipelined:
        return {}
    members = {}
    for r in groups:
        info = prob.cap.info[r.producer]
        if info.kind != PARAM:
            continue
        steps = plan_steps(r.src, r.dst, r.grad_partial if r.producer in prob.grad_nodes else (),
                           keep_partial=r.keep_partial)
        if groupable(steps):
            members[r.producer] = group_key(info.target_name, steps, first_meta(info.meta).dtype)
    return members


def float8_gathers(prob, groups: list, members: dict) -> dict:
    """{parameter node: (its float8 linear, the mesh axes its amax is reduced over)} of the grouped weights whose
    layer gathers them in float8 (cost/float8.gathers_in_float8): the group's axis and those splitting the
    weight as its linear reads it, as the runtime reduces them (runtime/reduction/layer_groups.py)."""
    out = {}
    for r in groups:
        if r.producer in members and _gather_itemsize(prob, r):
            axes = {members[r.producer][1]} | {a for a, p in enumerate(r.dst) if is_shard(p)}
            out[r.producer] = (r.consumers[0][0], tuple(sorted(axes)))
    return out


def _gather_itemsize(prob, r) -> int | None:
    """Bytes an element of redistribution r's gathered weight where its layer gathers it in float8
    (cost/float8.gathers_in_float8), else None (its own dtype's)."""
    itemsize = prob.gather_itemsize(r.producer)
    if not itemsize:
        return None
    steps = plan_steps(r.src, r.dst, r.grad_partial if r.producer in prob.grad_nodes else (),
                       keep_partial=r.keep_partial)
    hint = first_meta(prob.cap.info[r.producer].meta).hint
    return itemsize if gathers_in_float8(steps, hint, r.dst, prob.mesh.axis_sizes) else None


def bucketed(prob, choice, colls: list) -> list:
    """`colls` with each weight's data-axis gradient all-reduces replaced by the buckets that carry them
    (buckets.py): one all-reduce per bucket and axis, of the bucket's bytes, as the module launches them."""
    strategies = {n: ns.strategies[choice[n]] for n, ns in prob.strategies.items()}
    # the weights the buckets reduce, and the activations whose partial gradients flow on to them
    structure = prob.node_cost_cache.get(("graph uses",))
    if structure is None:
        structure = prob.node_cost_cache[("graph uses",)] = graph_uses(prob.cap)
    deferred = partial_gradients(prob.cap, strategies, prob.grad_nodes, structure)
    if not deferred:
        return colls
    out = [c for c in colls if not (c.kind == ALL_REDUCE and c.phase == "backward" and c.axis in deferred.get(c.tensor, ()))]
    weights = {n: axes for n, axes in deferred.items() if prob.cap.info[n].kind == PARAM}
    entries, sizes = [], {}
    for name, axes in reversed(weights.items()):   # backward makes the gradients in reverse order of use
        meta = first_meta(prob.cap.info[name].meta)
        itemsize = reduce_itemsize(prob.param_bytes, name) or meta.itemsize
        sizes[name] = numel(local_shape(meta.hint, strategies[name].output, prob.mesh.axis_sizes)) * itemsize
        entries.append((name, sizes[name] // itemsize, axes, itemsize, itemsize))
    for k, (axes, _, names) in enumerate(assign_buckets(entries, prob.bucket_bytes)):
        out += [Collective(ALL_REDUCE, a, sum(sizes[n] for n in names), "backward", f"gradient bucket {k}",
                           ",".join(names)) for a in axes]
    return out


def zero_bucketed(prob, choice, colls: list) -> list:
    """`colls` with the ZeRO weights' gradient reduce-scatters and weight all-gathers replaced by the buckets
    that carry them (buckets.zero_buckets, runtime/reduction/zero_buckets.py): one reduce-scatter per bucket,
    asynchronous in backward at level 2 (the overlap model hides those like DDP's buckets), at the optimizer
    step at 1; and one all-gather per bucket after the step."""
    cap, mesh = prob.cap, prob.mesh
    node_of, param_zero, sizes = {}, {}, {}
    for name, ns in prob.strategies.items():
        s, info = ns.strategies[choice[name]], cap.info[name]
        if info.kind == PARAM and s.zero and name in prob.grad_nodes:
            meta = first_meta(info.meta)
            node_of[info.target_name] = name
            param_zero[info.target_name] = (s.zero, tuple(mesh.axis_names[a] for a in s.zero_axes))
            sizes[info.target_name] = (numel(local_shape(meta.hint, s.output, mesh.axis_sizes)),
                                       reduce_itemsize(prob.param_bytes, name) or meta.itemsize,
                                       prob.param_bytes[name].weight if name in prob.param_bytes else meta.itemsize)
    order, ranks = params_by_first_use(cap), dict(zip(mesh.axis_names, mesh.axis_sizes))
    # each weight's own reduce-scatter and all-gather (cost/terms.zero_collectives), by (kind, weight, axis, phase)
    own = {(c.kind, c.tensor, c.axis, c.phase): c for c in colls if c.kind in (REDUCE_SCATTER, ALL_GATHER)}
    out, moved = list(colls), set()
    for level, phase, where in ((2, "backward", f"{BUCKET}ZeRO-2 "), (1, "optimizer", "ZeRO-1 gradient bucket ")):
        buckets = zero_buckets(order, param_zero, sizes, prob.bucket_bytes, level, ranks)
        for k, (a, fqns) in enumerate(buckets):
            axis, names = mesh.axis_names.index(a), [node_of[f] for f in fqns]
            # not a BUCKET `where` for the gather: it runs after the step, nothing hides it (overlap.py)
            for kind, ph, label in ((REDUCE_SCATTER, phase, f"{where}{k}"),
                                    (ALL_GATHER, "optimizer", f"ZeRO-{level} weight bucket {k}")):
                keys = [(kind, name, axis, ph) for name in names]
                moved.update(keys)
                out.append(Collective(kind, axis, sum(own[key].full_bytes for key in keys), ph, label,
                                      ",".join(names)))
    # a weight's own collective is named after it (`where`); a bucket's, after the bucket
    return [c for c in out if not (c.where == c.tensor and (c.kind, c.tensor, c.axis, c.phase) in moved)]


def zero_bucket_hold(colls: list):
    """Whole gradients ZeRO-2's buckets hold during backward (runtime/reduction/zero_buckets.py): the bucket filling,
    the one in flight, and the copy of it a backend may take (gloo's reduce-scatter does): three times the
    largest, a bound (NCCL takes no copy)."""
    sizes = [c.full_bytes for c in colls if c.where.startswith(f"{BUCKET}ZeRO-2 ")]
    return 3 * max(sizes) if sizes else 0


def _state_terms(prob, choice, symbolic: bool):
    """Bytes of weights (and buffers), master copies, gradients and optimizer state, and ZeRO's
    collectives of the weights."""
    params = master = grads = opt = update = 0
    colls = []
    for name, ns in prob.strategies.items():
        s, info = ns.strategies[choice[name]], prob.cap.info[name]
        if info.kind == PARAM:
            meta = first_meta(info.meta)
            m = param_memory(meta, s, prob.mesh, prob.param_bytes[name], symbolic=symbolic)
            params, master, grads, opt = params + m.params, master + m.master, grads + m.grads, opt + m.optimizer
            update = update + m.update
            if name in prob.grad_nodes:
                colls += zero_collectives(name, meta, s, prob.mesh, prob.param_bytes[name], symbolic)
        elif info.kind == BUFFER and info.meta is not None:
            meta = first_meta(info.meta)
            params = params + numel(meta.shape if symbolic else meta.hint) * meta.itemsize
    return params, master, grads, opt, update, colls


def _op_terms(prob, choice, symbolic: bool, saved, rerun: set):
    """Activation bytes kept for backward, compute seconds of all ops (recomputed ops twice forward), those of
    the memory-bound ones among them per compile region (compile_regions), and each op's seconds at the
    example's sizes (a number: the overlap model orders by it)."""
    cap = prob.cap
    op_terms: dict = {}   # kind of op -> [activation bytes, compute time, how many, seconds at the example's sizes,
    #                       memory-bound, compile region]
    times: dict = {}
    regions = compile_regions(prob)
    for name, ns in prob.strategies.items():
        if cap.info[name].kind not in (OP, INPUT):
            continue
        s = ns.strategies[choice[name]]
        # repeats of a block's op cost alike: price each kind once, count how many (80 layers
        # of sympy sums would otherwise dominate the planning time)
        float8 = prob.float8_of(name)
        key = (prob.canonical.get(name, name), choice[name], charge_key(saved, name), name in rerun, regions[name],
               float8)
        if key not in op_terms:
            a = activation_bytes(name, cap, s.output, prob.mesh, saved, symbolic, strategy=s)
            t = node_compute_time(cap.node(name), cap, s, prob.mesh, prob.hardware, symbolic, float8=float8)
            # a recomputed op runs its forward (a third of forward + backward) once more
            t = t + t / cm.TRAIN_FLOPS_FACTOR if name in rerun else t
            # the overlap model orders by time at the example's sizes (overlap.py): a number either way
            t_num = float(node_compute_time(cap.node(name), cap, s, prob.mesh, prob.hardware, False,
                                            float8=float8)) if symbolic else t
            op_terms[key] = [a, t, 0, t_num + t_num / cm.TRAIN_FLOPS_FACTOR if symbolic and name in rerun else t_num,
                             is_memory_bound(cap.node(name)), regions[name]]
        op_terms[key][2] += 1
        times[name] = op_terms[key][3]
    acts = 0 + sum(n * a for a, _, n, _, _, _ in op_terms.values())
    compute = 0 + sum(n * t for _, t, n, _, _, _ in op_terms.values())
    memory_bound = {region: 0 + sum(n * t for _, t, n, _, bound, r in op_terms.values() if bound and r == region)
                    for region in COMPILE_REGIONS}
    return acts, compute, memory_bound, times


# Where an op sits for a job that compiles only part of the model (Predicted.fused_time): inside a stack of
# repeated blocks (torchtitan compiles each transformer block), after the last of them (the head: final norm,
# output projection, a loss in the graph), or elsewhere (the embeddings; everything, in a model without blocks).
COMPILE_REGIONS = ("blocks", "head", "other")


def compile_regions(prob) -> dict:
    """Op or input node -> its compile region (COMPILE_REGIONS), once per problem."""
    found = prob.node_cost_cache.get(("compile regions",))
    if found is None:
        # stacks whose blocks repeat (some node of theirs has a first copy, prob.canonical): not any numbered
        # module list (an nn.Sequential head of a norm and a linear is none)
        stacks = [blocks for blocks in block_nodes(prob.cap).values()
                  if any(n.name in prob.canonical for nodes in blocks.values() for n in nodes)]
        in_blocks = {n.name for blocks in stacks for nodes in blocks.values() for n in nodes}
        order = [n.name for n in prob.cap.graph.nodes]
        last = max((i for i, name in enumerate(order) if name in in_blocks), default=len(order))
        found = {name: "blocks" if name in in_blocks else "head" if i > last else "other"
                 for i, name in enumerate(order)}
        prob.node_cost_cache[("compile regions",)] = found
    return found


def _op_collectives(prob, choice, rerun: set, symbolic: bool, passed: set = frozenset()) -> list[Collective]:
    """The collectives ops launch inside themselves (terms.op_collectives), again where they recompute. `passed`:
    the ops a rerun passes, those it replays from a per-op checkpoint's cache too: a cached float8 linear's
    matmul is replayed, and its amax all-reduces around it run again (runtime/lowering/per_op.py caches the
    matmul alone)."""
    colls = []
    for name, ns in prob.strategies.items():
        if prob.cap.info[name].kind == OP:
            own = op_collectives(prob.cap.node(name), prob.cap, ns.strategies[choice[name]], prob.mesh, symbolic,
                                 float8=prob.float8_of(name))
            again = name in rerun or (name in prob.float8 and name in passed)
            # a recomputed op runs its forward again (its backward's collectives run once)
            colls += own + ([replace(c, phase="recompute") for c in own if c.phase == "forward"] if again else [])
    if prob.float8:   # linears reading one activation share its scale (cost/float8.shared_input_scales)
        chosen = {n: prob.strategies[n].strategies[choice[n]] for n in prob.float8}
        running = [n for n, (k, n_out) in prob.float8.items()
                   if runs_float8(chosen[n], (n_out, k), prob.mesh.axis_sizes)]
        colls = shared_scale_amaxes(colls, shared_input_scales(prob.cap, running, chosen))
    return colls


def _region_of(stacks) -> dict:
    """op -> (stack path, block index) of the checkpointed block it is in."""
    return {n: (st.path, i) for st in stacks for i, block in enumerate(st.blocks) for n in block}


def _kept_weights(prob, groups, stacks, symbolic: bool):
    """Bytes of the FSDP weights kept gathered from forward to backward when the plan does not reshard after
    forward (Problem.reshard_after_forward False): one copy per layout change (the module gathers once for all
    its readers) that some reader outside a checkpointed block keeps; inside one, the recompute gathers it."""
    if reshards(prob):
        return 0
    region_of = _region_of(stacks)
    total = 0
    for r in groups:
        if any(c not in region_of and kept_weight_bytes(prob.cap, r.producer, c, i, r.src, r.dst, prob.grad_nodes,
                                                         prob.mesh) for c, i in r.consumers):
            total = total + gathered_weight_bytes(prob.cap, r.producer, r.src, r.dst, prob.mesh, symbolic,
                                                  _gather_itemsize(prob, r))
    return total


def _redistributions(prob, groups, stacks, rerun: set, symbolic: bool) -> list[Collective]:
    """The collectives of every redistribution, with those a checkpointed block's recompute runs again."""
    region_of = _region_of(stacks)
    order = _node_order(prob)
    memo = prob.node_cost_cache.setdefault(("redistribution collectives",), {})
    colls = []
    for r in groups:
        regions = {region_of.get(c) for c, _ in r.consumers}
        if len(regions) == 1 and None not in regions:
            # inside a checkpointed block: its forward collectives run again in backward's recompute, and
            # a weight gathered whole there is kept by the recompute rather than gathered a third time
            r = replace(r, regather_count=0)
            if min((c for c, _ in r.consumers), key=order.get) in rerun:   # it runs before its first reader
                forward = [c for c in redistribution_collectives(prob, r, symbolic, memo) if c.phase == "forward"]
                colls += [replace(c, phase="recompute") for c in forward]
        colls += redistribution_collectives(prob, r, symbolic, memo)
    return colls


def _node_order(prob) -> dict:
    """Node name -> its position in the graph, once per problem."""
    order = prob.node_cost_cache.get(("node order",))
    if order is None:
        order = prob.node_cost_cache[("node order",)] = {n.name: i for i, n in enumerate(prob.cap.graph.nodes)}
    return order


def _gathered_layers(prob, groups, members: dict) -> list:
    """Per forward op (prob.live's order): bytes of the FSDP layer groups gathered whole while it runs
    (layer_groups.alive_spans: its layer, the next one prefetched, the root). A weight's size does not
    depend on the batch, so these are numbers, symbolic prediction or not."""
    position = {point: i for i, (point, _) in enumerate(prob.live)}
    size, uses = {}, {}
    for r in groups:
        key = members.get(r.producer)
        if key is None:
            continue
        size[key] = size.get(key, 0) + int(gathered_weight_bytes(prob.cap, r.producer, r.src, r.dst, prob.mesh,
                                                                 itemsize=_gather_itemsize(prob, r)))
        uses.setdefault(key, []).extend(position[c] for c, _ in r.consumers if c in position)
    at = [0] * len(prob.live)
    for key, (start, end) in alive_spans(uses).items():
        for i in range(start, end + 1):
            at[i] += size[key]
    return at


def transient_bytes(prob, choice, groups, stacks, symbolic: bool, zero_hold=0):
    """The largest working set of any op; backward holds one recomputed block's activations at a time,
    and starts with the outputs' gradients and its first op's (backward_start_bytes), to which ZeRO-2's
    buckets add what they hold (`zero_hold`, counted as if from the start: a bound)."""
    transient = peak_working_set(prob, choice, groups, symbolic)
    start = backward_start_bytes(prob, choice, symbolic) + zero_hold
    # the block's rerun gathers its FSDP layer again, with the next one prefetched, beside what it recomputes:
    # the most of those gathered at any of its ops, as forward holds them there
    layers = _gathered_layers(prob, groups, layer_members(prob, groups)) if stacks and not prob.pipelined else []
    position = {point: i for i, (point, _) in enumerate(prob.live)}
    blocks, seen = [], set()
    for st in stacks:
        for block in rerun_blocks(st, prob.saved):   # a frozen block never reruns
            held = max([layers[position[n]] for n in block if n in position], default=0) if layers else 0
            key = (tuple((prob.canonical.get(n, n), choice.get(n), charge_key(prob.saved, n)) for n in block), held)
            if key in seen:   # repeats of a block hold alike: priced once
                continue
            seen.add(key)
            blocks.append(held + sum(activation_bytes(n, prob.cap, prob.strategies[n].strategies[choice[n]].output,
                                                      prob.mesh, prob.saved, symbolic,
                                                      strategy=prob.strategies[n].strategies[choice[n]])
                                     for n in block if n in prob.strategies))
    if not symbolic:
        return max([transient, start, *blocks])
    for x in [start, *blocks]:
        transient = _max_with(transient, x)
    return transient


def _max_with(m, x):
    """sympy.Max(m, x), without sympy's proofs where x is, coefficient by coefficient, no larger than one
    of m's arguments: the answer is then m. (sympy proves inequalities under assumptions to order a Max's
    arguments: 0.5-1 s per call on Llama-3-8B's ten working sets, for an answer known here.)"""
    args = m.args if isinstance(m, sympy.Max) else (m,)
    try:
        cx = _coefficients(sympy.expand(sympy.sympify(x)))
        covered = any(_covers(_coefficients(sympy.expand(a)), cx) for a in args)
    except sympy.PolynomialError:   # not a polynomial (a ceiling of an uneven split): sympy decides
        covered = False
    return m if covered else sympy.Max(m, x)


def backward_start_bytes(prob, choice, symbolic: bool):
    """What backward holds as it starts beyond the saved activations (liveness.BackwardStart): every output's
    gradient, in the layout the module returns it, and the largest set of input gradients that the op
    making one output computes, in the layout it reads them. 0 where nothing needs a gradient."""
    start = prob.backward_start
    if start is None or not start.graded:
        return 0
    out = prob.strategies[start.output].strategies[choice[start.output]]
    total = read_bytes(start.output, start.graded, prob.cap, out, prob.mesh, symbolic)
    heads = [read_bytes(h, positions, prob.cap, prob.strategies[h].strategies[choice[h]], prob.mesh, symbolic)
             for h, positions in start.heads if h in prob.strategies]
    if not heads:
        return total
    return total + (sympy.Max(*heads) if symbolic else max(heads))


def _comm_terms(colls, mesh, links, hints):
    """Bytes and seconds per mesh axis, and bytes per kind of collective; `hints`: the example's sizes, at which
    a symbolic all-reduce takes its algorithm (cm.collective_time)."""
    sent = {a: [] for a in mesh.axis_names}
    seconds = {a: [] for a in mesh.axis_names}
    by_kind: dict = {}
    terms: dict = {}   # (kind, axis, bytes) -> (bytes sent, seconds): repeated blocks repeat their collectives
    for c in colls:
        # the type too: an int and a float (or a sympy number) of one value are equal keys, not equal answers
        key = (c.kind, c.axis, type(c.full_bytes), c.full_bytes)
        found = terms.get(key)
        if found is None:
            a = mesh.axis_names[c.axis]
            found = terms[key] = (a, cm.bytes_moved(c.kind, c.full_bytes, mesh.axis_sizes[c.axis]),
                                  cm.collective_time(c.kind, c.full_bytes, mesh.axis_sizes[c.axis], links[a], hints))
        a, n, t = found
        sent[a].append(n)
        seconds[a].append(t)
        by_kind.setdefault(c.kind, []).append(n)
    return ({a: _total(xs) for a, xs in sent.items()}, {a: _total(xs) for a, xs in seconds.items()},
            {k: _total(xs) for k, xs in by_kind.items()})


def _total(terms: list):
    """sum(terms), in one sympy.Add when any is symbolic: adding one term at a time re-sorts the whole
    sum each time (seconds for a plan's thousands of collectives)."""
    if all(isinstance(t, (int, float)) for t in terms):
        return sum(terms)
    return sympy.Add(*terms)


def peak_working_set(prob, choice, groups, symbolic: bool):
    """The most bytes alive at one forward op beyond saved activations (see search/formulation._transient_rows):
    its outputs and inputs not kept for backward, the weights gathered whole for it, and the FSDP layers
    gathered (and prefetched) around it (_gathered_layers).

    The symbolic answer is the expression of the op that peaks at the example
    sizes: a Max over every op would be exact for all sizes but unreadable.
    """
    cap, mesh = prob.cap, prob.mesh
    members = layer_members(prob, groups)
    layers = _gathered_layers(prob, groups, members)
    gathered: dict = {}   # op -> (numeric, symbolic) bytes of weights gathered whole for it
    for r in groups:
        n = gathered_weight_bytes(cap, r.producer, r.src, r.dst, mesh)
        if not n or r.producer in members:
            continue
        e = gathered_weight_bytes(cap, r.producer, r.src, r.dst, mesh, symbolic=True) if symbolic else 0
        for consumer, _ in r.consumers:
            n0, e0 = gathered.get(consumer, (0, 0))
            gathered[consumer] = (n0 + n, e0 + e)
    best, peak, exprs = 0, 0, []
    canon = prob.canonical
    seen = set()
    for i, (point, alive) in enumerate(prob.live):
        layer_bytes = layers[i]
        key = (canon.get(point, point), tuple(sorted(canon.get(u, u) for u in alive)), layer_bytes)
        if key in seen:   # a repeated block's rows repeat its first copy's (same layouts, same bytes)
            continue
        seen.add(key)
        value, expr = gathered.get(point, (0, 0))
        value, expr = value + layer_bytes, expr + layer_bytes
        for u in alive:
            if u not in prob.strategies or is_saved(prob, u):
                continue
            layout = prob.strategies[u].strategies[choice[u]].output
            value = value + output_bytes(u, cap, layout, mesh)
            if symbolic:
                expr = expr + output_bytes(u, cap, layout, mesh, symbolic=True)
        if value > best:
            best, peak = value, len(exprs)
        exprs.append(expr)
    return upper_envelope(exprs, peak) if symbolic else best


def upper_envelope(exprs: list, best: int = 0):
    """The largest of `exprs` at every size: a Max of those no other one is at least as large as everywhere.

    Working sets are polynomials in the dynamic sizes (batch, seq) with positive coefficients, so one is
    at least another everywhere when none of its coefficients is smaller; usually one or two remain (under
    FSDP a gathered weight is a constant that peaks at small batches, an activation a slope that peaks at
    large ones), which keeps the expression readable and exact at every batch (whatif.max_batch). An
    expression that is no polynomial (a ceiling of an uneven split) leaves `exprs[best]`, the one that
    peaks at the example sizes.

    The Max is built unevaluated: sympy's evaluation would try to prove each argument no larger than
    another (about 1 s for Llama-3-8B's ten), which the coefficients have just settled."""
    # a repeated block's rows repeat their expressions: each distinct one expanded once (keyed by type too: an
    # int and a float of one value are equal keys, not equal expressions)
    expanded: dict = {}
    exprs = [expanded[(type(e), e)] if (type(e), e) in expanded else
             expanded.setdefault((type(e), e), sympy.expand(sympy.sympify(e))) for e in exprs]
    try:
        found: dict = {}
        coeffs = [found[(type(e), e)] if (type(e), e) in found else found.setdefault((type(e), e), _coefficients(e))
                  for e in exprs]
    except sympy.PolynomialError:
        return exprs[best] if exprs else 0
    first: dict = {}   # of equal ones, the first stays
    for i, c in enumerate(coeffs):
        first.setdefault(frozenset(c.items()), i)
    unique = list(first.values())
    # values at a few sizes: one expression below another at any of them cannot cover it, which settles
    # most pairs before _covers (distinct polynomials never cover each other both ways)
    names = sorted({x for c in coeffs for m in c for x, _ in m})
    sizes = [dict.fromkeys(names, 1), dict.fromkeys(names, 1024)] + [{**dict.fromkeys(names, 1), x: 1024}
                                                                     for x in names]
    at = {i: [_value(coeffs[i], size) for size in sizes] for i in unique}
    keep = [exprs[i] for i in unique
            if not any(j != i and all(u >= v for u, v in zip(at[j], at[i])) and _covers(coeffs[j], coeffs[i])
                       for j in unique)]
    return 0 if not keep else keep[0] if len(keep) == 1 else sympy.Max(*keep, evaluate=False)


def _value(coeffs: dict, size: dict) -> Fraction:
    total = Fraction(0)
    for m, c in coeffs.items():
        for x, k in m:
            c = c * size[x] ** k
        total += c
    return total


def _covers(a: dict, b: dict) -> bool:
    """Whether polynomial `a` is at least `b` at every size (each symbol a positive integer, so >= 1).

    Sufficient, not necessary: each of b's terms must be paid for by a's terms whose monomials are at
    least its own (x*y >= y when x >= 1), largest monomials of b first. It proves what sympy's Max proves
    on working sets (256*b*s >= 32*b*s + 32*s), for a fraction of the time."""
    if all(a.get(m, 0) >= b.get(m, 0) for m in {*a, *b}):
        return True
    if any(c < 0 for c in a.values()):
        return False
    left = dict(a)
    for m, need in sorted(b.items(), key=lambda mc: -sum(k for _, k in mc[0])):
        if need <= 0:
            continue
        powers = dict(m)
        # the smallest monomials that are still at least m pay first, keeping large ones for large needs
        payers = sorted((n for n in left if left[n] > 0 and all(dict(n).get(x, 0) >= k for x, k in powers.items())),
                        key=lambda n: sum(k for _, k in n))
        for n in payers:
            paid = min(left[n], need)
            left[n] -= paid
            need -= paid
            if need <= 0:
                break
        if need > 0:
            return False
    return True


def _coefficients(e) -> dict:
    """{monomial: coefficient} of a polynomial in its symbols; a monomial is ((symbol name, power), ...).
    Coefficients are Fractions: exact, and compared far faster than sympy numbers."""
    symbols = sorted(e.free_symbols, key=str)
    terms = {(): e} if not symbols else sympy.Poly(e, *symbols).as_dict()
    return {tuple((str(x), k) for x, k in zip(symbols, m) if k): _fraction(c) for m, c in terms.items()}


def _fraction(c) -> Fraction:
    c = sympy.sympify(c)
    if c.is_Float:
        return Fraction(float(c))
    if not c.is_Rational:
        raise sympy.PolynomialError(f"coefficient {c} is not a number")
    return Fraction(int(c.p), int(c.q))
