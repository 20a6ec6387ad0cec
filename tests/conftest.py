"""Hypothesis profiles: "ci" (the default) draws a few cases per test; HYPOTHESIS_PROFILE=thorough
draws many more (tests/test_drawn_models.py reads the profile's max_examples as its budget)."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          print_blob=True, max_examples=320)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
