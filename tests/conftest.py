"""Hypothesis profiles: "ci" (the default) draws a few cases per test; HYPOTHESIS_PROFILE=thorough
draws many more (tests/test_drawn_models.py reads the profile's max_examples as its budget).

Under pytest-xdist (scripts/test.sh runs one worker per core) each worker's torch takes its share of
the cores, not all of them: two workers of two threads each on two cores would only contend.

The capture cache (autopar/capture/cache.py) is off for the suite, subprocesses included: a test must
not write into the user's home, nor trace less than it means to; tests/test_capture_cache.py turns it
on in a temporary directory.

HiGHS's answers (autopar/search/solve_cache.py) are kept for the run, in a directory made for it and
shared by every worker and every rank a test launches: the suite plans the same toy models in many
files, and each distinct integer program is still solved once per run. Never in the user's ~/.cache;
tests/test_solve_cache.py gives each of its tests a cache of its own, and tests that watch HiGHS's
calls turn it off."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ["AUTOPAR_CAPTURE_CACHE"] = "0"
if "PYTEST_XDIST_WORKER" not in os.environ:   # the controller (or a run without workers); workers inherit it
    os.environ["AUTOPAR_SOLVE_CACHE"] = "1"
    os.environ["AUTOPAR_SOLVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-solves-")
    atexit.register(shutil.rmtree, os.environ["AUTOPAR_SOLVE_CACHE_DIR"], True)

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          print_blob=True, max_examples=320)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def small_problem():
    """The search's Problem for a 2-layer GPT planned on a 2x2 mesh: the smallest model with every kind of edge
    (weights, activations, a tied embedding) and pairs that cannot be redistributed. A fresh one per test,
    because a test may watch what the problem's caches fill with."""
    from autopar.capture.export import capture
    from autopar.planning.planner import plan_captured
    from autopar.testing import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    problems: dict = {}
    plan_captured(capture(model, (torch.randint(0, 32, (4, 8)),)), {"a": 2, "b": 2}, hardware="cpu",
                  problems=problems)
    (entry,) = problems.values()
    return entry[1]
