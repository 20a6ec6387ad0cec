"""The planner's choices and predictions stay as they were (scripts/plan_golden.py wrote them).

Planning is made fast by sharing and caching work across searches (issue 36); a cache keyed on too
little, or a search skipped that could have won, would change a plan without failing anything else.
These requests cover a tight memory limit (recomputation, re-gathering and resharding weighed), a
pipeline, a 3-axis mesh searched per role assignment, and Llama-3-8B's shape on 8 x 8."""
import math
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import plan_golden  # noqa: E402

GOLDEN = plan_golden.GOLDEN


def _diff(want, got, path="") -> list:
    """Where two plan JSONs differ: numbers beyond 1e-9 relative, symbolic predictions that differ by
    more at some size, anything else unequal."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: only in one" for k in set(want) ^ set(got)]
        for k in set(want) & set(got):
            out += _diff(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items, now {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in _diff(w, g, f"{path}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        ok = isinstance(got, (int, float)) and math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-30)
        return [] if ok else [f"{path}: {want!r}, now {got!r}"]
    if path.startswith(".symbolic") and isinstance(want, str) and isinstance(got, str) and want != got:
        return [] if _same_function(want, got) else [f"{path}: {want!r}, now {got!r}"]
    return [] if want == got else [f"{path}: {want!r}, now {got!r}"]


def _same_function(want: str, got: str) -> bool:
    """Whether two symbolic predictions agree to 1e-9 at every size on a grid of batch and sequence sizes:
    a sum's float coefficients may round in another order, and a Max may drop an argument it proves
    is never the largest, without the prediction changing."""
    import itertools
    import sympy
    a, b = sympy.sympify(want), sympy.sympify(got)
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    for values in itertools.product([1, 2, 3, 7, 16, 64, 100, 1024, 4096, 131072], repeat=len(symbols)):
        at = dict(zip(symbols, values))
        if not math.isclose(float(a.subs(at)), float(b.subs(at)), rel_tol=1e-9, abs_tol=1e-30):
            return False
    return True


@pytest.mark.parametrize("case", sorted(plan_golden.CASES))
def test_plan_unchanged(case):
    import json
    want = json.loads(GOLDEN.read_text())[case]
    got = json.loads(json.dumps(plan_golden.plan_case(case)))
    diffs = _diff(want, got)
    assert not diffs, f"{case}: the plan changed ({len(diffs)} differences):\n" + "\n".join(sorted(diffs)[:20])


def test_symbolic_predictions_compare_as_functions():
    assert _same_function("Max(256*batch*seq, 32*batch*seq + 32*seq)", "256*batch*seq")
    assert _same_function("0.1*batch + 0.2*batch", "0.30000000000000004*batch")
    assert not _same_function("Max(2*batch, seq)", "2*batch")
    assert _diff({"symbolic": {"x": "batch*seq"}}, {"symbolic": {"x": "batch*seq + 1e-6*seq"}})
