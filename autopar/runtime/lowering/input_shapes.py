"""The shapes a ParallelModule takes: this rank's shard of each input, checked against the captured graph
before it runs, so a wrong shape is an InputShapeError naming the input and dim rather than a failure
deep inside torch (or a silent computation on a shape the plan was not laid out for)."""
from __future__ import annotations

import torch

from ...capture.export import Captured
from ...errors import InputShapeError
from ...sharding.op_spec import tensor_args
from ...sharding.placement import dim_factor, shard_dim


def input_shape_specs(cap: Captured, plan) -> list:
    """Per user input: (name, captured whole shape as sympy, placements, allowed ranges), None for non-tensors."""
    out = []
    for name, placements in zip(cap.input_names, plan.input_placements):
        meta = cap.info[name].meta
        out.append(None if meta is None or isinstance(meta, list) else (name, meta.shape, placements,
                                                                         plan.mesh.axis_sizes, cap.ranges))
    return out


def check_input_shapes(specs: list, local_inputs) -> None:
    """Raise InputShapeError, naming the input and dim, for a shape the local graph cannot take.

    The graph would fail deep in torch ("mat1 and mat2 shapes cannot be multiplied") or, worse,
    compute on a shape it was not laid out for."""
    seen = {}
    for spec, t in zip(specs, local_inputs):
        if spec is None or not isinstance(t, torch.Tensor):
            continue
        name, shape, placements, sizes, ranges = spec
        if t.dim() != len(shape):
            raise InputShapeError(f"input {name!r} has {t.dim()} dims; the module was made for {len(shape)} "
                                  f"(shape {tuple(str(s) for s in shape)})")
        for d, expr in enumerate(shape):
            shards = dim_factor(placements, d, sizes)
            given = t.shape[d] * shards   # the whole size, as the plan counts it
            what = f"dim {d} of input {name!r}" + (f" (this rank's {t.shape[d]} x {shards} shards)" if shards > 1 else "")
            if expr.is_Integer and given != int(expr):
                raise InputShapeError(
                    f"{what} is {given}, but the module was captured with {int(expr)} there and that dim is "
                    f"static (the model's code fixes it, or dynamic_shapes= said so). Use inputs of that size, or "
                    f"parallelize with dynamic_shapes={{{name!r}: {{{d}: torch.export.Dim('d{d}')}}}} if the "
                    "model allows that dim to vary")
            if expr.is_Symbol:
                lo, hi = ranges.get(expr, (None, None))
                if (lo is not None and given < lo) or (hi is not None and given > hi):
                    raise InputShapeError(f"{what} is {given}; the model allows {expr} in [{lo}, {hi if hi is not None else 'inf'}]")
                if seen.setdefault(expr, (given, name, d))[0] != given:
                    first = seen[expr]
                    raise InputShapeError(f"{what} is {given}, but dim {first[2]} of input {first[1]!r} is {first[0]} "
                                          f"and the model needs them equal ({expr})")


def split_requirements(cap: Captured, plan) -> list:
    """(expression, pieces, node name, mesh axes) for each dynamic size the plan splits inside the graph: the
    sequence a context axis splits after the embedding, while every rank holds the whole input.

    The search checked the example's sizes; a call at another size has to divide too, or one rank fails in a
    reshape of its uneven share while the others wait in their next collective. Every rank evaluates these at
    the same whole sizes (`check_splits_divide`), so all of them raise together."""
    out, seen = [], set()
    for node in cap.graph.nodes:
        strategy = plan.node_strategies.get(node.name)
        if strategy is None:
            continue
        # the output as laid out, and each tensor input as this op wants it (the rules' order, op_spec.tensor_args)
        laid_out = [(node, strategy.output)] + list(zip(tensor_args(node), strategy.inputs))
        for tensor, placements in laid_out:
            metas = cap.info[tensor.name].meta if tensor.name in cap.info else None
            for meta in (metas if isinstance(metas, list) else [metas]):
                for d, expr in enumerate(meta.shape if meta is not None and placements is not None else ()):
                    f = dim_factor(placements, d, plan.mesh.axis_sizes)
                    if f > 1 and not expr.is_number and (expr, f) not in seen:
                        seen.add((expr, f))
                        axes = [plan.mesh.axis_names[a] for a, p in enumerate(placements) if shard_dim(p) == d]
                        out.append((expr, f, node.name, axes))
    return out


def call_sizes(specs: list, local_inputs) -> dict:
    """Each dynamic size symbol's whole value in this call ({symbol: (value, where it was read)}), read from the
    inputs as the plan lays them out (a split dim's local size times its pieces)."""
    values = {}
    for spec, t in zip(specs, local_inputs):
        if spec is None or not isinstance(t, torch.Tensor) or t.dim() != len(spec[1]):
            continue
        name, shape, placements, sizes, _ = spec
        for d, expr in enumerate(shape):
            if expr.is_Symbol and expr not in values:
                values[expr] = (t.shape[d] * dim_factor(placements, d, sizes), f"dim {d} of input {name!r}")
    return values


def check_splits_divide(requirements: list, values: dict) -> None:
    """Raise InputShapeError where this call's sizes (`call_sizes`) make a split of `split_requirements` uneven."""
    for expr, pieces, node, axes in requirements:
        if not expr.free_symbols <= values.keys():
            continue
        size = int(expr.xreplace({sym: v for sym, (v, _) in values.items()}))
        if size % pieces:
            read = ", ".join(f"{values[sym][1]} is {values[sym][0]} ({sym})"
                             for sym in sorted(expr.free_symbols, key=str))
            raise InputShapeError(
                f"{read}: the plan splits {expr}{'' if expr.is_Symbol else f' = {size}'} into {pieces} equal pieces "
                f"over mesh axes {axes} (at node {node!r}), and {pieces} does not divide {size}. Pad the sequence to "
                f"a multiple of {pieces}, or parallelize for this size")


def context_axes(requirements: list, axis_names: tuple, batch_axes: tuple) -> list:
    """The mesh axes (indices) that split a dynamic size other than the batch: their ranks must be called with
    the same sizes (`check_on_every_rank`)."""
    return sorted({axis_names.index(a) for *_, axes in requirements for a in axes if a not in batch_axes})


def check_on_every_rank(specs: list, requirements: list, context_axes: list, axis_groups: list,
                        local_inputs) -> None:
    """The checks above for a plan with context axes (`context_axes`), raising InputShapeError on every rank of
    the mesh when any rank's call fails them, before the graph's first collective.

    Each rank alone would pass or fail on its own: a rank called at a length the plan cannot split (13 on two
    context ranks) would fail in a reshape while the others wait forever in their first exchange, and ranks of
    one context axis handed different lengths (7 tokens here, 6 there) would each pass. So each rank checks its
    own call, the ranks of each context axis compare their sizes (max of each size and of its negative), and a
    flag of any failure goes round every axis, so the ranks of other groups (another data-parallel replica)
    raise too. `axis_groups`: (process group, size, name) per mesh axis. A few small all-reduces a call; on a
    GPU a host sync, paid only by plans with a context axis (cp, sp)."""
    import torch.distributed as dist
    error = None
    try:
        check_input_shapes(specs, local_inputs)
        values = call_sizes(specs, local_inputs)
        check_splits_divide(requirements, values)
    except InputShapeError as e:
        error, values = str(e), {}
    symbols = sorted({sym for spec in specs if spec is not None for sym in spec[1] if sym.is_Symbol}, key=str)
    for a in context_axes:
        group, size, name = axis_groups[a]
        if size == 1 or not symbols:
            continue
        mine = torch.tensor([values.get(sym, (0, ""))[0] for sym in symbols], dtype=torch.int64,
                            device=_device(group))
        both = torch.cat([mine, -mine, torch.tensor([int(error is not None)], device=mine.device)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        longest, shortest = both[:len(symbols)].tolist(), (-both[len(symbols):2 * len(symbols)]).tolist()
        if error is None and not both[-1]:   # sizes of a rank that failed are not compared: it says why itself
            for sym, hi, lo in zip(symbols, longest, shortest):
                if hi != lo:
                    error = (f"{values[sym][1]} ({sym}) is {lo} on some ranks of mesh axis {name!r} and {hi} on "
                             f"others (this rank's: {values[sym][0]}): the ranks of an axis that splits the "
                             "sequence must be called with the same sizes. Cut the global batch with "
                             "plan.local_inputs / plan.local_kwargs")
                    break
    failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=_device(axis_groups[0][0]))
    for group, size, _ in axis_groups:
        if size > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise InputShapeError(error)
    if failed.item():
        raise InputShapeError("another rank of the mesh was called with sizes this plan cannot run (its own "
                              "InputShapeError says which); every rank stops here rather than wait for it in a "
                              "collective")


def _device(group) -> torch.device:
    """Where a tensor for `group`'s collectives lives: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def ordered_inputs(keys: list, constants: dict, args: tuple, kwargs: dict) -> list:
    """The inputs of a call `pm(*args, **kwargs)` in the graph's placeholder order (`keys`: each placeholder's
    position or keyword, Captured.input_keys), checked against the call the model was captured with.

    A Python constant (a flag, or None) was baked into the graph as traced (`constants`), so a call that
    gives another value, a tensor where there was none, or a keyword never seen, would silently compute
    something else: each is an InputShapeError naming the input."""
    num_positional = sum(1 for k in [*keys, *constants] if isinstance(k, int))
    if len(args) != num_positional:
        raise InputShapeError(f"the parallel module takes {num_positional} positional inputs (this rank's shard of "
                              f"each, from plan.local_inputs), got {len(args)}")
    given = {**dict(enumerate(args)), **kwargs}
    for key, value in given.items():
        what = f"keyword input {key!r}" if isinstance(key, str) else f"input {key}"
        if key in constants:
            if not _same_constant(value, constants[key]):
                raise InputShapeError(f"{what} is {_short(value)}, but the model was captured with {constants[key]!r} "
                                      "there, which its graph has baked in; call it with that value, or parallelize "
                                      "with example inputs that hold this one")
        elif key not in keys and value is not None:
            raise InputShapeError(f"{what} was not among the example inputs the model was captured with (keywords "
                                  f"{sorted(k for k in keys if isinstance(k, str))}); give it in example_kwargs= "
                                  "when parallelizing, or leave it out")
    missing = [k for k in keys if k not in given]
    for key in constants:
        if key not in given and constants[key] is not None:
            missing.append(key)
    if missing:
        raise InputShapeError(f"keyword input(s) {missing} missing: the model was captured with them "
                              "(example_kwargs=), and its graph takes them at every call")
    return [given[k] for k in keys]


def _same_constant(value, captured) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(captured, torch.Tensor):
        return False
    return type(value) is type(captured) and value == captured


def _short(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
