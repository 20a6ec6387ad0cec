"""Named classic strategies as restrictions of the same search space.

"ddp", "zero1", "zero2", "fsdp" (ZeRO-3), "tp", "tp+sp", "fsdp+tp", "cp", "fsdp+cp", "fsdp+tp+cp" (and
"auto", which restricts nothing) pin the role of each mesh axis, taken in mesh order; the ILP then finds the cheapest
plan that plays those roles. So a classic is a baseline priced by the same
cost model, not a separate code path.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

from cost_models import format_bytes

from ..capture.export import INPUT, OP, PARAM, NodeInfo
from ..cost.problem import Problem
from ..cost.terms import SDPA, first_meta, param_memory
from ..errors import AutoparError, DivisibilityWarning, ShardingError
from ..mesh import MeshSpec
from ..sharding.op_spec import op_name, tensor_args
from ..sharding.placement import P, R, is_shard, local_shape, numel, shard_dim, uneven_dims
from ..sharding.redistribute import UnsupportedRedistribution, plan_steps
from ..sharding.strategies import batch_derived

DP, FSDP, TP, ZERO1, ZERO2 = "dp", "fsdp", "tp", "zero1", "zero2"
# auto on a mesh of many axes (role_assignments): the axis splits the batch, and each parameter is
# replicated, split (FSDP) or ZeRO-split over it as the search finds cheapest
DATA = "data"
# the pipeline axis (pipeline.py): stages hold different layers, so within a stage every tensor is whole on it
PIPE = "pipe"
DATA_ROLES = (DP, FSDP, ZERO1, ZERO2, DATA)   # axes that split the batch
# context parallelism: the axis splits the sequence (each rank attends from its rows of the query to keys
# and values gathered whole); its weights are kept as Roles.context_weights says
CONTEXT = "context"
# how a context axis stores weights (always used whole): "whole" as dp does; "split" as fsdp does, which is
# torchtitan's FSDP over its dp_shard_cp mesh (the data and context ranks flattened); "any": the search
# chooses per weight (auto's context candidates)
WHOLE, SPLIT, ANY = "whole", "split", "any"
CONTEXT_WEIGHTS = (WHOLE, SPLIT)   # what PlanOptions.context_weights may ask for
CONTEXT_STRATEGIES = ("cp", "fsdp+cp", "fsdp+tp+cp")
ZERO_LEVEL = {ZERO1: 1, ZERO2: 2}
STRATEGIES = ("auto", "ddp", "zero1", "zero2", "fsdp", "tp", "tp+sp", "fsdp+tp", "cp", "fsdp+cp", "fsdp+tp+cp")


@dataclass(frozen=True)
class Roles:
    """Role of each mesh axis (None: free for the search)."""
    roles: tuple
    axis_names: tuple = ()
    axis_sizes: tuple = ()
    sequence_parallel: bool = False  # tp axes also split what lies between the matmuls
    context_weights: str = WHOLE     # how context axes store weights: WHOLE, SPLIT or ANY (above)

    def weight_role(self, a: int):
        """The role axis `a` plays for weights: a context axis that splits them is an FSDP axis to them."""
        role = self.roles[a]
        return FSDP if role == CONTEXT and self.context_weights == SPLIT else role

    def batch_axes(self) -> dict[int, bool]:
        """Axes whose batch split is pinned: True = the batch is split there (never on an axis of one rank,
        where no layout splits anything: sharding/strategies.py)."""
        return {a: r in DATA_ROLES and (not self.axis_sizes or self.axis_sizes[a] > 1)
                for a, r in enumerate(self.roles) if r is not None}


def axis_roles(strategy: str, mesh: MeshSpec, context_weights: str | None = None) -> Roles:
    """The roles of the mesh's axes under `strategy`. `context_weights` (PlanOptions.context_weights): how the
    context axes store weights, "whole" or "split"; None: split under "fsdp+cp" and "fsdp+tp+cp" (FSDP over the
    data and context axes together, as torchtitan's dp_shard_cp), whole under "cp" (as ddp), the search's choice
    under "auto" (planning/options.check_context_weights checks the request)."""
    n = mesh.num_axes
    if strategy == "auto":
        return Roles((None,) * n, mesh.axis_names, mesh.axis_sizes, context_weights=context_weights or ANY)
    if strategy == "ddp":
        return Roles((DP,) * n, mesh.axis_names, mesh.axis_sizes)
    if strategy == "fsdp":
        return Roles((FSDP,) * n, mesh.axis_names, mesh.axis_sizes)
    if strategy in ZERO_LEVEL:
        return Roles((strategy,) * n, mesh.axis_names, mesh.axis_sizes)
    if strategy == "tp+sp":
        return Roles((TP,) * n, mesh.axis_names, mesh.axis_sizes, sequence_parallel=True)
    if strategy == "tp":
        return Roles((TP,) * n, mesh.axis_names, mesh.axis_sizes)
    if strategy == "cp":
        return Roles((CONTEXT,) * n, mesh.axis_names, mesh.axis_sizes, context_weights=context_weights or WHOLE)
    if strategy in ("fsdp+cp", "fsdp+tp+cp"):
        # the axes before cp are data axes (fsdp on the first, dp on the rest) and may be absent, as in
        # torchtitan's runs with dp_shard 1: then only the context axis can split the weights
        tail = (CONTEXT,) if strategy == "fsdp+cp" else (CONTEXT, TP)
        if n < len(tail):
            raise AutoparError(
                f"strategy 'fsdp+tp+cp' needs a mesh of at least 2 axes (cp on the second last, tp on the last, "
                f"any data axes before them, as torchtitan orders them); this mesh has one: {mesh}. Use 'fsdp+cp' "
                f"or 'cp', or a mesh with a tp axis last.")
        weights = context_weights or SPLIT
        if n == len(tail) and weights == WHOLE:
            raise AutoparError(
                f"strategy {strategy!r} on mesh {mesh} has no data axis (it takes the axes before "
                f"{'the last' if len(tail) == 1 else 'the last two'} as data axes), so with "
                f"context_weights='whole' no axis would split the weights; leave context_weights unset (the "
                f"weights are then split over the context axis, as torchtitan's FSDP over dp_shard x cp does "
                f"with dp_shard 1), {'use strategy=' + repr('cp') + ', ' if len(tail) == 1 else ''}or add a data "
                f"axis first")
        data = (FSDP,) + (DP,) * (n - len(tail) - 1) if n > len(tail) else ()
        return Roles(data + tail, mesh.axis_names, mesh.axis_sizes, context_weights=weights)
    if strategy == "fsdp+tp":
        if n < 2:
            raise AutoparError(
                f"strategy 'fsdp+tp' needs a mesh of at least 2 axes (fsdp on the first, tp on the last); "
                f"this mesh has one: {mesh}. Use 'fsdp' or 'tp', or a 2-axis mesh.")
        return Roles((FSDP,) + (DP,) * (n - 2) + (TP,), mesh.axis_names, mesh.axis_sizes)
    raise AutoparError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def with_pipeline(roles: Roles, mesh: MeshSpec, axis: int) -> Roles:
    """`roles` (for the mesh without the pipeline axis) with the pipeline axis put back at `axis`."""
    return Roles(roles.roles[:axis] + (PIPE,) + roles.roles[axis:], mesh.axis_names, mesh.axis_sizes,
                 roles.sequence_parallel, roles.context_weights)


def role_assignments(mesh: MeshSpec, intra_node: list[bool], num_free: int = 0) -> list[Roles]:
    """What `auto` tries on a mesh of many axes: each axis splits the batch (data) or the model (tp).

    One search over every layout on every axis grows as (layouts per axis)^axes
    per node and its square per edge; fixing each axis's role first keeps every
    search small, and these assignments cover the plans people build by hand
    (DP/FSDP/ZeRO x TP x SP), with the search still choosing per parameter and
    per op within each role. Tensor parallelism is tried only on axes inside a
    node (`intra_node`; on any axis if none is): it communicates in every
    layer, forward and backward, which a link between nodes (~10x slower)
    does not carry at speed. `num_free`: how many axes are left to the search
    unrestricted (None), for when no assignment of roles alone fits, e.g. a
    batch too small to split over every data axis.
    """
    tp_ok = intra_node if any(intra_node) else [True] * mesh.num_axes
    options = [(DATA, TP, None) if ok else (DATA, None) for ok in tp_ok]
    return [Roles(combo, mesh.axis_names, mesh.axis_sizes) for combo in itertools.product(*options)
            if sum(r is None for r in combo) == num_free]


def allowed_param_storage(roles: Roles, info: NodeInfo, strategies) -> list[bool]:
    """Which storage layouts a parameter may take under the roles.

    dp axes keep it whole; tp axes split every matrix that can be split;
    fsdp axes split it wherever the split can still be gathered back to the
    layout the op uses (a dim a tp axis already splits cannot be split again
    by an outer fsdp axis and gathered alone), else keep it whole.
    """
    def use_of(storage):   # (context axes use weights whole too: allow_edge)
        return tuple(R if role in DATA_ROLES or role == CONTEXT else p for role, p in zip(roles.roles, storage))

    def gatherable(storage):
        try:
            # directly: a gather-then-cut path would gather on the tp axes too
            plan_steps(storage, use_of(storage), fallback=False)
            return True
        except UnsupportedRedistribution:
            return False

    def tp_split(strategy, a):
        return _even_split(info, strategy, a, roles.axis_sizes)

    for a, role in enumerate(roles.roles):
        if (role == TP and roles.axis_sizes[a] > 1 and info.meta is not None and info.meta.ndim >= 2
                and not any(tp_split(t, a) for t in strategies)):   # (one rank: nothing to split)
            raise ShardingError(
                f"parameter {info.target_name!r} of shape {tuple(info.meta.hint)}: tensor-parallel axis "
                f"{roles.axis_names[a]!r} of size {roles.axis_sizes[a]} divides none of its dims, so it cannot "
                f"be split; use a tp degree that divides {tuple(info.meta.hint)}, or strategy='auto'")
    ok = []
    for s in strategies:
        good = True
        for a, role in enumerate(roles.roles):
            p = s.output[a]
            if role == PIPE and (p != R or a in s.zero_axes):
                good = False
            if (role in (DP, ZERO1, ZERO2) or role == CONTEXT and roles.context_weights == WHOLE) and p != R:
                good = False
            if role not in (None, DATA) and a in s.zero_axes and ZERO_LEVEL.get(role) != s.zero:
                good = False
            if role == TP and is_shard(p) and not tp_split(s, a):
                good = False
            if role == TP and info.meta is not None and info.meta.ndim >= 2 and not is_shard(p) and any(
                    tp_split(t, a) for t in strategies):
                good = False
        ok.append(good and gatherable(s.output))
    for a in range(len(roles.roles)):
        if roles.weight_role(a) != FSDP:
            continue
        # among layouts that agree on every other axis, split on this one if any can
        def others(s):
            return s.output[:a] + s.output[a + 1:]
        can_split = {others(s) for o, s in zip(ok, strategies) if o and is_shard(s.output[a])}
        ok = [o and (is_shard(s.output[a]) or others(s) not in can_split) for o, s in zip(ok, strategies)]
    zero_axes = tuple(a for a, role in enumerate(roles.roles) if role in ZERO_LEVEL)
    if zero_axes and any(o and s.zero_axes == zero_axes for o, s in zip(ok, strategies)):
        # ZeRO over every zero axis where the flat tensor divides; whole (as DDP) where it does not
        ok = [o and s.zero_axes == zero_axes for o, s in zip(ok, strategies)]
    return ok


def _even_split(info: NodeInfo, strategy, a: int, axis_sizes) -> bool:
    """Does the storage split on axis `a`, evenly? Tensor parallelism runs ops on the stored shards, and
    only an even split will do (placement.py)."""
    p = strategy.output[a]
    return is_shard(p) and shard_dim(p) not in uneven_dims(info.meta.hint, strategy.output, axis_sizes)


def allowed_op_strategies(roles: Roles, strategies, takes_tuple: bool = False, on_batch: bool = True,
                          carries_batch: bool = False, rows_split_on: tuple | None = None) -> list[bool]:
    """Ops split only the batch (dim 0) on data-parallel axes, and never the batch on tp axes. (`on_batch`:
    the op computes on activations; dim 0 of an op on the weights alone, a regularizer, is no batch, and a
    tp axis may split it as it splits the weight.)

    On a context axis an op on activations splits them anywhere but along the batch (`carries_batch`: its
    output's dim 0 is the batch), and may not run replicated if it can run split: that is what splitting
    the sequence means, and left free the search would keep small models whole there (no collectives).
    (`rows_split_on`: for attention, per strategy the axes that split its query's rows, which only context
    axes may: excluded before the rules above look at what else the op can do.)

    With sequence parallelism an op on a tp axis may not run replicated if it
    can run split at all: norms, dropout and residual adds then split along
    the sequence (their hidden dim being whole), and the all-reduce after a
    row-parallel matmul becomes a reduce-scatter plus an all-gather before
    the next column-parallel one. (`takes_tuple`: a getitem, which takes its
    tuple's layout as it is, is exempt.)
    """
    def ok(strategy):
        for a, role in enumerate(roles.roles):
            if role is None:
                continue
            pls = list(strategy.inputs) + [strategy.output]
            if role == PIPE and any(pl[a] != R for pl in pls):
                return False
            # P: a reduction over the batch (a loss), pending its all-reduce
            if role in DATA_ROLES and any(pl[a] not in (R, "S(0)", P) for pl in pls):
                return False
            if role == TP and on_batch and strategy.output[a] == "S(0)":
                return False
            if role == CONTEXT and carries_batch and strategy.output[a] == "S(0)":
                return False
        return True

    allowed = [ok(s) for s in strategies]
    if rows_split_on is not None:
        allowed = [o and all(roles.roles[a] == CONTEXT for a in axes) for o, axes in zip(allowed, rows_split_on)]
    if on_batch and not takes_tuple:
        for a, role in enumerate(roles.roles):
            # where it can split its output; an op that can only pass partial sums on (a slice of labels
            # the axis does not divide, which reads a padded length) may run whole
            if role == CONTEXT and any(o and is_shard(s.output[a]) for o, s in zip(allowed, strategies)):
                allowed = [o and s.output[a] != R for o, s in zip(allowed, strategies)]
    if roles.sequence_parallel and not takes_tuple:
        for a, role in enumerate(roles.roles):
            if role != TP:
                continue
            if any(o and s.output[a] != R for o, s in zip(allowed, strategies)):
                allowed = [o and s.output[a] != R for o, s in zip(allowed, strategies)]
    return allowed


def allow_edge(roles: Roles, producer: NodeInfo, src, dst, consumer_replicated_only: bool = False) -> bool:
    """Parameters are used whole on data-parallel axes and as stored on tensor-parallel ones."""
    if producer.kind != PARAM:
        # activations keep their batch split on data-parallel axes (else the "data-parallel"
        # axis would quietly compute replicated), except into an op that can only run whole
        if consumer_replicated_only:
            return True
        # (P -> R: the all-reduce that completes a reduction over the batch, e.g. a loss)
        return all(src[a] == dst[a] or (src[a] == R and dst[a] == "S(0)") or (src[a] == P and dst[a] == R)
                   for a, role in enumerate(roles.roles) if role in DATA_ROLES)
    for a, role in enumerate(roles.roles):
        if (role in DATA_ROLES or role == CONTEXT) and dst[a] != R:
            return False
        # tensor-parallel weights are used as stored; a replicated bias may be added once
        # into partial sums (R -> P), as Megatron's row-parallel linear does
        if role == TP and dst[a] != src[a] and not (src[a] == R and dst[a] == P):
            return False
    return True


def check_tensor_parallel_divisibility(cap, roles: Roles) -> None:
    """Named tp strategies split attention by head: warn when the tp degree does not divide the heads.

    The plan stays correct (the search then splits attention another way or
    gathers the heads it cannot split, paying for it in communication), but a
    user who asks for tp expects Megatron's layout and should hear at once why
    they will not get it. With sequence parallelism the sequence must divide too.
    """
    degree, axes = _role_degree(roles, TP)
    if not axes:
        return
    for node in cap.graph.nodes:
        if node.op == "call_function" and op_name(node) == "aten.embedding.default":
            vocab = cap.info[tensor_args(node)[0].name].meta.hint[0]
            if vocab % degree:
                warnings.warn(
                    f"tensor-parallel degree {degree} ({axes}) does not divide the vocabulary ({vocab}) of the "
                    f"embedding in module {cap.info[node.name].module_path or '<root>'!r}, so neither it nor a "
                    f"tied output projection can be split by vocab; pad the vocabulary to a multiple of {degree}",
                    DivisibilityWarning, stacklevel=4)
        if node.op != "call_function" or op_name(node) != "aten.scaled_dot_product_attention.default":
            continue
        q_node, k_node = tensor_args(node)[:2]
        q = cap.info[q_node.name].meta
        where = cap.info[node.name].module_path or "<root>"
        for what, count in (("query heads", q.hint[1]), ("key/value heads", _kv_heads(cap, k_node))):
            if count % degree:
                warnings.warn(
                    f"tensor-parallel degree {degree} ({axes}) does not divide the {count} {what} of the "
                    f"attention in module {where!r}, so attention cannot be split by head (the plan gathers "
                    f"what it cannot split); use a tp degree that divides {count} for Megatron's layout",
                    DivisibilityWarning, stacklevel=4)
                return
        if roles.sequence_parallel and q.hint[2] % degree:
            warnings.warn(
                f"sequence parallelism over {axes} needs the sequence length ({q.hint[2]}, attention in "
                f"module {where!r}) to divide by {degree}; norms there will not be split by sequence",
                DivisibilityWarning, stacklevel=4)
            return


def _role_degree(roles: Roles, role: str) -> tuple[int, str]:
    """(the product of the sizes of the axes in `role`, those axes as "name=size x ..."; "" if none)."""
    axes = [a for a, r in enumerate(roles.roles) if r == role]
    degree = 1
    for a in axes:
        degree *= roles.axis_sizes[a]
    return degree, " x ".join(f"{roles.axis_names[a]}={roles.axis_sizes[a]}" for a in axes)


def check_context_divisibility(cap, roles: Roles) -> None:
    """Context axes split the sequence evenly or not at all (placement.py's uneven splits are for weights): a
    sequence they do not divide is refused by name, before a search that would find no layout."""
    degree, axes = _role_degree(roles, CONTEXT)
    if degree == 1:
        return
    for node in cap.graph.nodes:
        if node.op != "call_function" or op_name(node) != SDPA:
            continue
        q = cap.info[tensor_args(node)[0].name].meta
        rows = q.hint[-2]
        if rows % degree:
            where = cap.info[node.name].module_path or "<root>"
            raise ShardingError(
                f"context parallelism over {axes} splits the sequence into {degree} even chunks, but the attention "
                f"in module {where!r} has a sequence of {rows}, which {degree} does not divide; pad the sequence to "
                f"a multiple of {degree} (padding masked out by the attention mask), or use another strategy")


# what each role promises to split: the whole weight (fsdp, tp) or its optimizer state (ZeRO),
# and how much of a parameter's bytes that split divides
_PROMISE = {FSDP: "every weight", TP: "every weight matrix",
            ZERO1: "the optimizer state of every weight", ZERO2: "the gradient and optimizer state of every weight"}
_SPLIT_PARTS = {FSDP: ("params", "master", "grads", "optimizer"), TP: ("params", "master", "grads", "optimizer"),
                ZERO1: ("master", "optimizer"), ZERO2: ("master", "grads", "optimizer")}
_NAMED = 3   # weights a message names before it gives only the count


def check_promised_splits(cap, roles: Roles, strategy: str, chosen: dict, param_bytes: dict) -> None:
    """A named strategy that leaves weights whole where it promises to split them says so.

    FSDP and ZeRO split any weight, padded where the axis size does not divide
    (placement.py), but tp splits only evenly, and neither splits a dim another
    axis splits already unless it divides: so an axis may split nothing and the
    plan be DDP in effect there. If no weight splits on such an axis the
    strategy was not applied at all: ShardingError. If some stay whole because
    the axis cannot split them: one DivisibilityWarning with what they cost. (Weights whole although they
    divide are whole by the layout rules, e.g. a bias tp already splits under
    fsdp+tp: allowed_param_storage.)
    `chosen`: parameter node -> its chosen Strategy; `param_bytes`: node -> ParamBytes.
    """
    notes = []
    for a in range(len(roles.roles)):
        role, n = roles.weight_role(a), roles.axis_sizes[a]
        if role not in _PROMISE or n == 1:
            continue
        promised = [m for m in chosen if _promised(role, cap.info[m].meta)]
        whole = [m for m in promised if not _is_split(role, chosen[m], a)]
        num_zero = sum(1 for r in roles.roles if r in ZERO_LEVEL)
        indivisible = [m for m in whole if not _divides(role, _shape_on_axis(roles, cap.info[m].meta, chosen[m], a),
                                                        n, _free_dims(cap.info[m].meta, chosen[m], a), num_zero)]
        if not indivisible:
            continue
        if len(whole) == len(promised):
            raise ShardingError(_none_split_message(cap, roles, strategy, a, chosen, len(promised), indivisible))
        notes.append(_some_whole_note(cap, roles, strategy, a, chosen, param_bytes, len(promised), indivisible))
    if notes:
        # stacklevel: the caller of autopar.plan (here < _check_named_strategy < _flat_plan < _plan_captured < plan)
        warnings.warn("; ".join(notes), DivisibilityWarning, stacklevel=6)


def _promised(role, meta) -> bool:
    if role == TP:
        return meta.ndim >= 2               # norms and biases may stay whole under Megatron's layout
    if role in ZERO_LEVEL:
        return meta.dtype.is_floating_point  # only weights an optimizer steps have optimizer state
    return meta.ndim >= 1                   # fsdp: a scalar has no dim to split


def _is_split(role, strategy, a: int) -> bool:
    return a in strategy.zero_axes if role in ZERO_LEVEL else is_shard(strategy.output[a])


def _free_dims(meta, strategy, a: int) -> bool:
    """Does the weight have a dim that no axis but `a` splits (so `a` may split it unevenly)?"""
    taken = {shard_dim(p) for b, p in enumerate(strategy.output) if b != a and is_shard(p)}
    return any(d not in taken for d in range(meta.ndim))


def _shape_on_axis(roles: Roles, meta, strategy, a: int) -> tuple:
    """The shape the axis would split: the weight as the other axes leave it."""
    others = tuple(R if b == a else p for b, p in enumerate(strategy.output))
    return local_shape(meta.hint, others, roles.axis_sizes)


def _divides(role, shape: tuple, n: int, free_dims=None, zero_axes: int = 1) -> bool:
    """Can an axis of size n split this weight (`shape`: as the other axes leave it)?

    Evenly always; unevenly (padded, placement.py) FSDP a dim no other axis splits (`free_dims`),
    ZeRO a flat tensor over one axis; tp never (its ops run on the shards)."""
    if role in ZERO_LEVEL:   # ZeRO splits the flat tensor
        return numel(shape) % n == 0 or zero_axes == 1
    if role == FSDP and free_dims:
        return True
    return any(d % n == 0 for d in shape)


def _dividing_size(role, shapes: list, n: int):
    """The largest axis size below n that splits the most of these shapes (None: no size splits any)."""
    best = max(range(2, n), key=lambda d: (sum(_divides(role, s, d) for s in shapes), d), default=None)
    return best if best is not None and any(_divides(role, s, best) for s in shapes) else None


def _indivisible(cap, roles: Roles, a: int, chosen: dict, num_promised: int, nodes: list) -> str:
    """The clause that names them, e.g. "its size 3 does not divide any dim of 2 of the 5 weights: 'w' (4, 5)"."""
    role, n = roles.weight_role(a), roles.axis_sizes[a]
    which = f"the {num_promised}" if len(nodes) == num_promised else f"{len(nodes)} of the {num_promised}"
    shown = ", ".join(_shape_text(cap, roles, chosen, a, m) for m in nodes[:_NAMED])
    more = f" and {len(nodes) - _NAMED} more" if len(nodes) > _NAMED else ""
    what = "the element count" if role in ZERO_LEVEL else "any dim"
    return f"its size {n} does not divide {what} of {which} weights: {shown}{more}"


def _shape_text(cap, roles: Roles, chosen: dict, a: int, m: str) -> str:
    """"'w' (16, 8)", and what the axis would split where the other axes split the weight already."""
    whole = tuple(cap.info[m].meta.hint)
    left = tuple(_shape_on_axis(roles, cap.info[m].meta, chosen[m], a))
    return f"{cap.info[m].target_name!r} {whole}" + (f" ({left} as the other axes leave it)" if left != whole else "")


def _advice(cap, roles: Roles, a: int, chosen: dict, nodes: list) -> str:
    role, name, n = roles.weight_role(a), roles.axis_names[a], roles.axis_sizes[a]
    size = _dividing_size(role, [_shape_on_axis(roles, cap.info[m].meta, chosen[m], a) for m in nodes], n)
    return f"a {name!r} size that divides them" + (f" (e.g. {size})" if size else "")


def _none_split_message(cap, roles: Roles, strategy: str, a: int, chosen: dict, num_promised: int,
                        indivisible: list) -> str:
    role, name = roles.weight_role(a), roles.axis_names[a]
    whole = "context_weights='whole'" if roles.roles[a] == CONTEXT else "strategy='ddp'"
    return (f"strategy {strategy!r} splits {_PROMISE[role]} over mesh axis {name!r}, but it splits none there "
            f"({_indivisible(cap, roles, a, chosen, num_promised, indivisible)}), so the plan would be DDP in "
            f"effect on {name!r}. Use "
            f"{_advice(cap, roles, a, chosen, indivisible)}, or {whole} to keep weights whole on purpose, "
            f"or strategy='auto'")


def _some_whole_note(cap, roles: Roles, strategy: str, a: int, chosen: dict, param_bytes: dict,
                     num_promised: int, indivisible: list) -> str:
    role, name, n = roles.weight_role(a), roles.axis_names[a], roles.axis_sizes[a]
    mesh = MeshSpec(roles.axis_names, roles.axis_sizes)
    extra = 0.0
    for m in indivisible:   # what splitting them n ways would save on each device
        memory = param_memory(cap.info[m].meta, chosen[m], mesh, param_bytes[m])
        extra += sum(getattr(memory, part) for part in _SPLIT_PARTS[role]) * (1 - 1 / n)
    counted = "element counts" if role in ZERO_LEVEL else "dims"
    return (f"strategy {strategy!r} splits {_PROMISE[role]} over mesh axis {name!r}, but leaves "
            f"{len(indivisible)} whole there ({_indivisible(cap, roles, a, chosen, num_promised, indivisible)}); "
            f"this costs {format_bytes(extra)} more per device than splitting them {n} ways. Pad those {counted} "
            f"to a multiple of {n}, or use {_advice(cap, roles, a, chosen, indivisible)}")


_HEAD_REPEAT_OPS = {"aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.expand.default",
                    "aten.unsqueeze.default", "aten.clone.default", "aten.contiguous.default", "aten.slice.Tensor"}


def _kv_heads(cap, k_node) -> int:
    """Key/value heads before any GQA repeat: models that repeat keys to the query head count
    (HF's repeat_kv: unsqueeze, expand, reshape) hide the true count from the attention op."""
    heads, node = None, k_node
    while True:
        meta = cap.info[node.name].meta
        if getattr(meta, "ndim", 0) == 4:
            heads = meta.hint[1] if heads is None else min(heads, meta.hint[1])
        if node.op != "call_function" or op_name(node) not in _HEAD_REPEAT_OPS:
            return heads
        if op_name(node) == "aten.slice.Tensor" and cap.info[node.args[0].name].meta != meta:
            return heads   # a slice that keeps everything is part of the repeat (x[:, :, None] traced dynamic)
        node = node.args[0]


def _batch_derived(prob: Problem) -> set:
    """sharding.strategies.batch_derived of the problem's graph, worked out once per problem."""
    key = ("batch_derived",)
    if key not in prob.node_cost_cache:
        prob.node_cost_cache[key] = batch_derived(prob.cap)
    return prob.node_cost_cache[key]


def allowed_flags(prob: Problem, roles: Roles, name: str) -> list[bool]:
    """Per strategy of node `name`, whether the roles allow it."""
    info, strategies = prob.cap.info[name], prob.strategies[name].strategies
    if info.kind == PARAM:
        return allowed_param_storage(roles, info, strategies)
    if info.kind == OP:
        node = prob.cap.node(name)
        takes_tuple = any(isinstance(prob.cap.info[a.name].meta, list) for a in tensor_args(node))
        on_batch = name in _batch_derived(prob)
        rows_split_on = None
        if op_name(node) == SDPA:
            # the query's rows split only on context axes: elsewhere the roles' own layouts stay as they were
            rows = prob.cap.info[tensor_args(node)[0].name].meta.ndim - 2
            rows_split_on = [tuple(a for a, p in enumerate(s.inputs[0]) if shard_dim(p) == rows) for s in strategies]
        return allowed_op_strategies(roles, strategies, takes_tuple, on_batch, on_batch and _carries_batch(prob, info),
                                     rows_split_on)
    return [True] * len(strategies)


def _carries_batch(prob: Problem, info: NodeInfo) -> bool:
    """Is the op's output dim 0 as long as a user input's batch (so splitting it splits the batch)?"""
    key = ("batch_sizes",)
    if key not in prob.node_cost_cache:
        prob.node_cost_cache[key] = {m.hint[0] for i in prob.cap.info.values() if i.kind == INPUT
                                     for m in [first_meta(i.meta)] if m is not None and m.ndim > 0}
    meta = first_meta(info.meta)
    return meta is not None and meta.ndim > 0 and meta.hint[0] in prob.node_cost_cache[key]
