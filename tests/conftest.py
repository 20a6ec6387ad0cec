"""Hypothesis profiles: "ci" (the default) draws a few cases per test; HYPOTHESIS_PROFILE=thorough
draws many more (tests/test_drawn_models.py reads the profile's max_examples as its budget).

Under pytest-xdist (scripts/test.sh runs one worker per core) each worker's torch takes its share of
the cores, not all of them: two workers of two threads each on two cores would only contend.

The capture cache (autopar/capture/cache.py) is off for the suite, subprocesses included: a test must
not write into the user's home, nor trace less than it means to; tests/test_capture_cache.py turns it
on in a temporary directory."""
import os

import torch
from hypothesis import HealthCheck, settings

os.environ["AUTOPAR_CAPTURE_CACHE"] = "0"

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          print_blob=True, max_examples=320)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
