"""One capture for everything a distributed run traces of one model.

Under torch's threaded process group (autopar.testing.run_threaded: N ranks as N threads of one process)
every rank calls parallelize on its own copy of the same model, and each would trace it. torch.export
holds a process-wide lock (_compat.trace_lock), so the N traces run one after another: N times one
trace's seconds, most of an equivalence test (a tiny Hugging Face GPT-2 takes ~8 s to trace, its two
ranks' training steps well under one). Here the ranks of one run share one capture: the first traces,
the others take its capture where theirs would be the same graph. In a run of one process per rank
(torchrun, gloo or NCCL) a process that parallelizes one model several times (a strategy, then another;
a model, then a fresh copy to resume into) traces it once.

"The same graph" is the capture cache's key (cache.capture_key: the code, the model's structure, state and
attributes, the call), plus the compute dtype and the values of the model's plain tensor attributes (the
key has their shapes; their values become the graph's constants, which the runtime reads from the
capture). A model the key cannot describe is traced every time. Nothing reads a capture's weight values:
the runtime takes the weights from the model it is given (runtime/store.py).

The table belongs to the run: to the threaded process group's world, which it makes anew for each run, or
to this process's default process group. Nothing outlives the run (a later run, or test, traces again and
sees the warnings tracing gives), and outside one nothing is shared.
"""
from __future__ import annotations

import hashlib
import threading
import weakref

import torch
import torch.distributed as dist

from .._compat import threaded_world, trace_lock
from .cache import capture_key
from .export import Captured


class _Table:
    def __init__(self):
        self.lock = threading.Lock()
        self.captures: dict = {}


# a run's table, by what owns the run (_run_owner); weak, so that it goes with the run. A process group
# takes no attributes of ours (a C++ object), unlike the threaded world
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _run_owner():
    """The threaded run's world (one for all its ranks), this process's default process group, or None."""
    world = threaded_world()
    if world is not None:
        return world
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def shared_in_run(capture_fn, label: str = ""):
    """`capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)`, shared within the distributed run
    going on (by the ranks of a threaded run, by the calls of one process of a run); `label`: what else tells
    captures apart (the compute dtype the capture traces at)."""
    def capture(model, example_inputs, dynamic_shapes, example_kwargs=None) -> Captured:
        owner = _run_owner()
        key = _key(model, example_inputs, dynamic_shapes, example_kwargs, label) if owner is not None else None
        if key is None:
            return capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
        with trace_lock:   # one table per run, made once however many ranks ask at the same time
            table = _TABLES.setdefault(owner, _Table())
        with table.lock:   # the others wait for the first rank's trace, then take it
            if key not in table.captures:
                table.captures[key] = capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
            return table.captures[key]
    return capture


def _key(model, example_inputs, dynamic_shapes, example_kwargs, label: str) -> str | None:
    key = capture_key(model, example_inputs, dynamic_shapes, example_kwargs)
    if key is None:
        return None
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                digest.update(f"{name}.{attr}".encode())
                digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{key}|{label}|{digest.hexdigest()}"
