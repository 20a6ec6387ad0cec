"""The shapes a ParallelModule takes: this rank's shard of each input, checked against the captured graph
before it runs, so a wrong shape is an InputShapeError naming the input and dim rather than a failure
deep inside torch (or a silent computation on a shape the plan was not laid out for)."""
from __future__ import annotations

import torch

from ...capture.export import Captured
from ...errors import InputShapeError
from ...sharding.placement import dim_factor


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
