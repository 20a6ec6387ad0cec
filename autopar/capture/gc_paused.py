"""Python's cyclic garbage collector paused while a bounded, allocation-heavy step of planning runs.

Tracing a model and cutting a pipeline make millions of small objects that live on (fx nodes, fake tensors,
sympy expressions, per-op cost tables); each full collection walks all of them, and the allocation counts
trigger several while one plan is made (on a 405B Llama, about a second of the capture's and the stage cut's
time). Reference counting still frees what is not in a cycle; cycles made meanwhile are collected at the next
collection after the step. Process-wide like the collector: a step started while it is paused (by the user or
another thread's step) leaves it as it found it.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
