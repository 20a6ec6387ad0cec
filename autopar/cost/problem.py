"""The problem both solvers read: every node's candidate strategies, the edges between them, and
what each choice costs in seconds and bytes.

The cost stage's product. search/formulation.py turns it into an integer program (search/ilp.py
solves it) and search/greedy.py walks it in graph order; cost/predict.py prices the one choice
they return. The prices are memoised on the Problem (a deep model asks the same question of every
layer), so one Problem serves every role assignment the search tries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import cost_models as cm

from ..capture.export import BUFFER, INPUT, OP, OUTPUT, PARAM, Captured
from ..mesh import MeshSpec
from ..sharding.op_spec import tensor_args
from ..sharding.placement import numel
from ..sharding.redistribute import ALL_GATHER, UnsupportedRedistribution
from ..sharding.strategies import NodeStrategies
from .buckets import DEFAULT_BUCKET_BYTES
from .checkpointing import checkpointed_model
from .float8 import FLOAT8_ITEMSIZE
from .overlap import ring_hidden
from .terms import (activation_bytes, collectives_time, edge_collectives, edge_seconds, first_meta,
                    node_compute_time, op_collectives, param_memory, reduce_itemsize, regathers, zero_collectives)


@dataclass
class Edge:
    producer: str
    consumer: str
    index: int          # which tensor input of the consumer


@dataclass
class Problem:
    cap: Captured
    mesh: MeshSpec
    links: dict
    hardware: object
    strategies: dict[str, NodeStrategies]
    edges: list[Edge]
    grad_nodes: set
    saved: object                                    # activations.ActivationModel (cost.saved_outputs)
    param_bytes: dict = field(default_factory=dict)  # parameter node -> ParamBytes (precision.py)
    canonical: dict = field(default_factory=dict)    # node of a repeated block -> its first copy (blocks.py)
    live: list = field(default_factory=list)         # (op, storages alive there) per forward op (liveness.py)
    backward_start: object = None                    # liveness.BackwardStart: the gradients backward starts with
    edge_cost_cache: dict = field(default_factory=dict, repr=False)  # see edge_cost
    signature_ids: dict = field(default_factory=dict, repr=False)    # see edge_signature
    edge_signatures: dict = field(default_factory=dict, repr=False)  # see edge_signature
    pair_prices: dict = field(default_factory=dict, repr=False)      # see pair_seconds
    stacks: tuple = ()                               # checkpointing.CheckpointStack: may be recomputed
                                                     # (a stack's path twice: whole blocks, and their cores)
    checkpoint_models: dict = field(default_factory=dict, repr=False)  # see checkpoint_model
    node_cost_cache: dict = field(default_factory=dict, repr=False)    # see repeat_memory, classics._batch_derived
    bucket_bytes: int = DEFAULT_BUCKET_BYTES          # gradient buckets' size (buckets.py)
    # an activation gathered whole for an op that keeps it: kept as its shard and gathered again in backward
    # (True; Megatron's sequence parallelism), kept whole (False), or whichever is faster within a memory
    # limit (None: the search tries both; search/ilp.solve)
    regather_activations: bool | None = False
    # an FSDP weight gathered whole for an op that keeps it: kept as its shard and gathered again in backward
    # (True; FSDP2's default), kept whole until backward (False: one all-gather per layer less, its weights'
    # memory more), or whichever is faster within a memory limit (None: search/ilp.solve tries both)
    reshard_after_forward: bool | None = True
    pipelined: bool = False                          # stages hold their own weights: no FSDP layer groups
    # linear node -> (K, N) of each linear priced and run in float8 (float8.py), in graph order, by this recipe
    float8: dict = field(default_factory=dict)
    float8_recipe: str = "tensorwise"

    # parameter nodes whose all-gathers move float8 where a layout change gathers them so (float8.py:
    # enable_fsdp_float8_all_gather); none on a pipeline, whose stages gather no layer groups
    float8_gathered: frozenset = frozenset()

    def float8_of(self, name: str) -> str | None:
        """The float8 recipe node `name` runs by, None when it runs in the compute dtype."""
        return self.float8_recipe if name in self.float8 else None

    def gather_itemsize(self, name: str) -> int | None:
        """Bytes per element of parameter `name`'s all-gathers where its layout change gathers it in float8
        (float8.gathers_in_float8); None: its own dtype's."""
        return FLOAT8_ITEMSIZE if name in self.float8_gathered and not self.pipelined else None


def build_edges(cap: Captured, strategies: dict) -> list[Edge]:
    edges = []
    for node in cap.graph.nodes:
        if node.name not in strategies or node.op == "placeholder":
            continue
        for i, a in enumerate(tensor_args(node)):
            if a.name in strategies:
                edges.append(Edge(a.name, node.name, i))
    return edges


def edge_cost(prob: Problem, e: Edge, src, dst, grad_partial, keep_partial=(), signature=None) -> float:
    """Seconds of the collectives on edge e for one layout pair (memoised: a deep model asks
    the same question of every layer, and the answer depends only on what the key holds)."""
    key = (edge_signature(prob, e) if signature is None else signature, src, dst, grad_partial, keep_partial)
    cost = prob.edge_cost_cache.get(key)
    if cost is None:
        cost = prob.edge_cost_cache[key] = _edge_cost(prob, e, src, dst, grad_partial, keep_partial)
    if isinstance(cost, _Refused):
        raise UnsupportedRedistribution(cost.reason)
    return cost


@dataclass
class _PairPrices:
    """edge_cost of one edge signature for every layout pair priced so far, as an array: NaN where not priced
    yet, inf where the pair cannot be redistributed."""
    rows: dict            # producer key (output layout, ZeRO axes) -> row
    cols: dict            # consumer key (input layout, partial-gradient axes) -> column
    seconds: np.ndarray


def pair_seconds(prob: Problem, e: Edge, signature: int, src_keys: list, dst_keys: list, a: np.ndarray,
                 b: np.ndarray) -> np.ndarray:
    """edge_cost of edge e (whose signature is `signature`) for each pair (src_keys[a[j]], dst_keys[b[j]]), inf
    where it cannot be redistributed. The search asks this of every allowed pair of every edge of every role
    assignment (405B on 4 axes: 773k distinct pairs, most asked more than once): an array lookup each, and Python
    only for a pair not priced before."""
    table = prob.pair_prices.get(signature)
    if table is None:
        table = prob.pair_prices[signature] = _PairPrices({}, {}, np.full((0, 0), np.nan))
    rows = np.array([table.rows.setdefault(k, len(table.rows)) for k in src_keys], dtype=np.intp)
    cols = np.array([table.cols.setdefault(k, len(table.cols)) for k in dst_keys], dtype=np.intp)
    have = table.seconds.shape
    if len(table.rows) > have[0] or len(table.cols) > have[1]:   # grown by doubling, so rarely copied
        grown = np.full((max(have[0], 2 ** math.ceil(math.log2(max(len(table.rows), 1)))),
                         max(have[1], 2 ** math.ceil(math.log2(max(len(table.cols), 1))))), np.nan)
        grown[:have[0], :have[1]] = table.seconds
        table.seconds = grown
    ri, ci = rows[a], cols[b]
    out = table.seconds[ri, ci]
    for j in np.flatnonzero(np.isnan(out)).tolist():   # priced for the first time
        (p, zero_axes), (dst, gp) = src_keys[a[j]], dst_keys[b[j]]
        price = _edge_cost(prob, e, p, dst, gp, zero_axes)
        out[j] = table.seconds[ri[j], ci[j]] = math.inf if isinstance(price, _Refused) else price
    return out


@dataclass(frozen=True)
class _Refused:
    """A layout pair that cannot be redistributed, as edge_cost caches it: the reason, not the exception. A
    cached exception keeps the frames of its traceback alive, and re-raising it chains every raise's frames
    onto it (measured: ~1 GB more per search on a 4-axis mesh, where most of ~1M pairs ask again)."""
    reason: str


def edge_signature(prob: Problem, e: Edge) -> int:
    """An id of all an edge's cost depends on besides the two layouts: edges with one id cost the same. (An
    int, not the tuple: the search hashes it with every layout pair it prices, ~500k for Llama-3-70B on three
    axes, and the tuple's sympy sizes hash slowly.)"""
    # (memoised per edge and what of the problem it reads: a search asks it of every repeat of every edge, and
    # a problem's variants -- re-gathered activations, weights kept whole -- share these dicts)
    key = (e.producer, e.consumer, e.index, prob.regather_activations and id(prob.saved), reshards(prob))
    sig = prob.edge_signatures.get(key)
    if sig is not None:
        return sig
    meta = first_meta(prob.cap.info[e.producer].meta)
    # (the example's sizes, not the symbolic shape: the search prices at the example's sizes, and ints hash fast)
    described = (meta.hint, meta.dtype, prob.cap.info[e.producer].kind == PARAM, e.producer in prob.grad_nodes,
                 edge_regathers(prob, e), reduce_itemsize(prob.param_bytes, e.producer),
                 prob.gather_itemsize(e.producer))
    sig = prob.edge_signatures[key] = prob.signature_ids.setdefault(described, len(prob.signature_ids))
    return sig


def _edge_cost(prob: Problem, e: Edge, src, dst, grad_partial, keep_partial):
    """Seconds, or why the pair cannot be redistributed (_Refused; cached too: asked again, it is raised again)."""
    info = prob.cap.info[e.producer]
    try:
        return edge_seconds(first_meta(info.meta), info.kind == PARAM, src, dst, grad_partial, prob.mesh, prob.links,
                            e.producer in prob.grad_nodes, edge_regathers(prob, e), keep_partial=keep_partial,
                            reduce_itemsize=reduce_itemsize(prob.param_bytes, e.producer),
                            seconds=prob.edge_cost_cache.setdefault(("collective seconds",), {}),
                            gather_itemsize=prob.gather_itemsize(e.producer))
    except UnsupportedRedistribution as err:
        return _Refused(str(err))


def recompute_edge_cost(prob: Problem, e: Edge, src, dst, grad_partial, keep_partial=(), signature=None) -> float:
    """Seconds more that edge e costs when backward reruns its consumer's checkpointed block: its
    forward collectives run again, and a weight gathered whole there is kept by the rerun instead
    of gathered again for backward (so FSDP pays nothing more)."""
    key = ("recompute", edge_signature(prob, e) if signature is None else signature, src, dst, grad_partial,
           keep_partial)
    cost = prob.edge_cost_cache.get(key)
    if cost is None:
        colls = edge_collectives(e.producer, src, dst, grad_partial, prob.cap, prob.mesh,
                                 e.producer in prob.grad_nodes, False, e.consumer, keep_partial=keep_partial,
                                 reduce_itemsize=reduce_itemsize(prob.param_bytes, e.producer),
                                 gather_itemsize=prob.gather_itemsize(e.producer))
        forward = [c for c in colls if c.phase == "forward"]
        cost = float(collectives_time(forward, prob.mesh, prob.links))
        if edge_regathers(prob, e):
            cost -= float(collectives_time([c for c in forward if c.kind == ALL_GATHER], prob.mesh, prob.links))
        prob.edge_cost_cache[key] = cost
    return cost


def node_recompute_time(prob: Problem, name: str, s) -> float:
    """What an op costs again when a checkpointed block reruns it in backward: its forward's compute (a
    third of its training time) and the collectives it launches in forward (its backward's run once)."""
    node, float8 = prob.cap.node(name), prob.float8_of(name)
    compute = float(node_compute_time(node, prob.cap, s, prob.mesh, prob.hardware, float8=float8)) \
        / cm.TRAIN_FLOPS_FACTOR
    colls = [c for c in op_collectives(node, prob.cap, s, prob.mesh, float8=float8) if c.phase == "forward"]
    return compute + float(collectives_time(colls, prob.mesh, prob.links))


def node_time(prob: Problem, name: str, s) -> float:
    """Compute time of an op (and of the collectives it launches itself); for a trained parameter, its share
    of the optimizer step (the bytes its update moves: a weight every rank keeps whole is updated whole on every
    rank, as predict prices the step) and, under ZeRO, its reduce-scatter and all-gather."""
    info = prob.cap.info[name]
    if info.kind == PARAM:
        if name not in prob.grad_nodes:
            return 0.0
        meta = first_meta(info.meta)
        update = float(cm.optimizer_time(param_memory(meta, s, prob.mesh, prob.param_bytes[name]).update, prob.hardware))
        if not s.zero:
            return update
        colls = zero_collectives(name, meta, s, prob.mesh, prob.param_bytes[name])
        return update + float(collectives_time(colls, prob.mesh, prob.links))
    node, float8 = prob.cap.node(name), prob.float8_of(name)
    compute = float(node_compute_time(node, prob.cap, s, prob.mesh, prob.hardware, float8=float8))
    colls = op_collectives(node, prob.cap, s, prob.mesh, float8=float8)
    t = compute + float(collectives_time(colls, prob.mesh, prob.links))
    if colls and prob.hardware.comm_overlaps_compute:   # a ring's key/value sends hide behind its own steps
        t -= sum(ring_hidden(colls, {name: compute}, prob.mesh, prob.links, prob.cap.hints).values())
    return t


def node_memory(prob: Problem, name: str, s, saved=None) -> float:
    """Bytes a node's strategy costs: a parameter's storage, or the activations the node pays for
    under `saved` (an activations.ActivationModel; the problem's own, without checkpointing)."""
    info = prob.cap.info[name]
    if info.kind == PARAM:
        m = param_memory(first_meta(info.meta), s, prob.mesh, prob.param_bytes[name])
        return float(m.params + m.master + m.grads + m.optimizer)
    if info.kind in (OP, INPUT):   # a checkpoint holds the user inputs its block reads
        return float(activation_bytes(name, prob.cap, s.output, prob.mesh, saved or prob.saved, strategy=s))
    return 0.0


def repeat_memory(prob: Problem, name: str, first: str) -> list:
    """node_memory of each strategy of `name`, a repeat of `first`: repeats that pay the same charges
    (all but a block's edges) are priced once -- per problem, so once for all role assignments."""
    key = ("memory", first, charge_key(prob.saved, name))
    mems = prob.node_cost_cache.get(key)
    if mems is None:
        mems = prob.node_cost_cache[key] = [node_memory(prob, name, s) for s in prob.strategies[name].strategies]
    return mems


def edge_regathers(prob: Problem, e: Edge) -> int:
    """terms.regathers of edge e under the problem's choices (undecided resharding prices as resharded)."""
    return regathers(prob.cap, e.producer, e.consumer, e.index, prob.grad_nodes, regather_model(prob),
                     reshard_weights=reshards(prob))


def reshards(prob: Problem) -> bool:
    """Are FSDP weights kept as shards between forward and backward (Problem.reshard_after_forward)?"""
    return prob.reshard_after_forward is not False


def regather_model(prob: Problem):
    """The activation model the re-gather terms read (terms.regathers, regather_saving), or None when the
    problem keeps gathered activations whole."""
    return prob.saved if prob.regather_activations else None


def checkpoint_model(prob: Problem, keys: tuple):
    """The activation model with the stacks of `keys` ((path, kind) pairs, CheckpointStack.key)
    checkpointed (built once per set of stacks)."""
    keys = tuple(sorted(keys))
    model = prob.checkpoint_models.get(keys)
    if model is None:
        stacks = [st for st in prob.stacks if st.key in keys]
        model = prob.checkpoint_models[keys] = checkpointed_model(prob.cap, prob.hardware, stacks)
    return model


def memory_reserve(prob: Problem) -> float:
    """Memory outside the ILP's terms: buffers, which stay whole on every rank."""
    total = 0.0
    for info in prob.cap.info.values():
        meta = first_meta(info.meta) if info.meta is not None else None
        if meta is not None and info.kind == BUFFER:
            total += numel(meta.hint) * meta.itemsize
    return total


def follows_batch(prob: Problem, name: str) -> bool:
    """Is this node split over exactly the batch axes: a user input with a batch dim, or the output?"""
    info = prob.cap.info[name]
    if info.kind == INPUT:
        meta = first_meta(info.meta)
        return meta is not None and meta.ndim > 0
    return info.kind == OUTPUT


def tied_edges(prob: Problem) -> list[list[Edge]]:
    """Edges grouped by the variables they join: repeats of one edge in repeated blocks share them."""
    groups: dict = {}
    for e in prob.edges:
        key = (prob.canonical.get(e.producer, e.producer), prob.canonical.get(e.consumer, e.consumer), e.index)
        groups.setdefault(key, []).append(e)
    return list(groups.values())


def charge_key(model, name: str) -> tuple:
    """A node's charges without their labels: tied repeats of a node pay alike (but for the one attention of
    them that pays for the mask all keep as rings)."""
    return tuple((c.meta, c.cut_by, c.when, c.unless, c.view, c.follows) for c in model.charges.get(name, ())) \
        + ((name in model.ring_masks),)
