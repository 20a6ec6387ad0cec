"""Tracing a model as it computes under a mixed-precision policy.

Under `precision="bf16-mixed"` the ops see bf16 weights: the module keeps
each parameter once, in the master dtype (float32), and casts it to the
compute dtype where it is used, as FSDP2's MixedPrecisionPolicy does. The
graph that runs must therefore be the model's graph at the compute dtype,
with the casts the model's own code makes (a norm computed in float32 and
cast back, rotary tables made in float32 and cast to the activations' dtype):
a trace of the float32 model records none of them, since a cast to a tensor's
own dtype is no op.

`traced_in(model, dtype)` swaps every floating parameter for an empty tensor
of that dtype on the parameter's own device for the length of a trace (export
reads only shapes, dtypes and devices: the kernels a device runs decide the
strides, and with them which values share storage, see cost/activations.py),
keeps tied parameters tied, and puts the model's own tensors back after. A
meta-built model's stand-ins are on meta, so nothing is allocated; a model
with real weights costs, while it is traced, untouched memory the size of its
weights in the compute dtype. Buffers keep their dtype: they are fed as they
are at run time, as FSDP2 leaves them.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .._compat import trace_lock


@contextlib.contextmanager
def traced_in(model: torch.nn.Module, dtype: torch.dtype | None):
    """For the duration, `model`'s floating parameters are meta tensors of `dtype` (None: unchanged)."""
    if dtype is None:
        yield
        return
    swapped = []   # (module, name, the model's own parameter)
    stand_ins: dict = {}   # id(own parameter) -> its stand-in, so tied weights stay one parameter
    try:
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if not p.dtype.is_floating_point or p.dtype == dtype:
                    continue
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device),
                                                          requires_grad=p.requires_grad)
                swapped.append((module, name, p))
                setattr(module, name, stand_ins[id(p)])
        yield
    finally:
        for module, name, p in reversed(swapped):
            setattr(module, name, p)


def cast_inputs(inputs: tuple, dtype: torch.dtype | None) -> tuple:
    """Floating tensor inputs in `dtype` (FSDP2's cast_forward_inputs): a float32 input would meet
    bf16 weights in the first matmul. Integer inputs (token ids) pass as they are."""
    if dtype is None:
        return inputs
    return tuple(_cast(t, dtype) for t in inputs)


def cast_kwargs(kwargs: dict, dtype: torch.dtype | None) -> dict:
    """cast_inputs for keyword inputs."""
    return kwargs if dtype is None else {k: _cast(t, dtype) for k, t in kwargs.items()}


def _cast(t, dtype: torch.dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t


def own_param_dtypes(model: torch.nn.Module) -> dict:
    """Parameter name -> the dtype the model holds it in (what a policy's 'master' None means)."""
    return {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}


def at_compute_dtype(capture_fn, model: torch.nn.Module, dtype: torch.dtype | None):
    """`capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)`, tracing the model with its floating weights and
    inputs in `dtype` and recording it (`Captured.compute_dtype`, `.param_dtypes`); `capture_fn` itself
    when `dtype` is None or the model's own. (The weights traced in `dtype` keep their requires_grad: the
    capture's `frozen_params` are the model's.)"""
    own = own_param_dtypes(model)
    if dtype is None or {d for d in own.values() if d.is_floating_point} <= {dtype}:
        return capture_fn

    def traced(model, example_inputs, dynamic_shapes, example_kwargs=None):
        # the lock around the swap too: a thread tracing the same model must not see it half restored
        with trace_lock, traced_in(model, dtype):
            cap = capture_fn(model, cast_inputs(example_inputs, dtype), dynamic_shapes,
                             cast_kwargs(example_kwargs or {}, dtype))
        return dataclasses.replace(cap, compute_dtype=dtype, param_dtypes=own)
    return traced
