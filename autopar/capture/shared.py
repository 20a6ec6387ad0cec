"""One capture for all the ranks of a threaded run.

Under torch's threaded process group (autopar.testing.run_threaded: N ranks as N threads of one process)
every rank calls parallelize on its own copy of the same model, and each would trace it. torch.export
holds a process-wide lock (_compat.trace_lock), so the N traces run one after another: N times one
trace's seconds, most of an equivalence test (a tiny Hugging Face GPT-2 takes ~8 s to trace, its two
ranks' training steps well under one). Here the ranks of one run share one capture: the first traces,
the others take its capture where theirs would be the same graph.

"The same graph" is the capture cache's key (cache.capture_key: the code, the model's structure, state and
attributes, the call), plus the compute dtype and the values of the model's plain tensor attributes (the
key has their shapes; their values become the graph's constants, which the runtime reads from the
capture). A model the key cannot describe is traced by every rank.

The table lives on the run's distributed world, which the threaded process group makes anew for each
run: nothing outlives the run (a later run, or test, traces again and sees the warnings tracing gives),
and a run of one process per rank (torchrun) shares nothing, as there is nothing to share.
"""
from __future__ import annotations

import hashlib
import threading

import torch

from .._compat import threaded_world, trace_lock
from .cache import capture_key
from .export import Captured


class _Table:
    def __init__(self):
        self.lock = threading.Lock()
        self.captures: dict = {}


def shared_in_run(capture_fn, label: str = ""):
    """`capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)`, shared by the ranks of a threaded
    run; `label`: what else tells captures apart (the compute dtype the capture traces at)."""
    def capture(model, example_inputs, dynamic_shapes, example_kwargs=None) -> Captured:
        world = threaded_world()
        key = _key(model, example_inputs, dynamic_shapes, example_kwargs, label) if world is not None else None
        if key is None:
            return capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
        with trace_lock:   # one table per run, made once however many ranks ask at the same time
            table = world.__dict__.setdefault("autopar_captures", _Table())
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
