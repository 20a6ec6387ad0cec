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
    """Where two plan JSONs differ: numbers beyond 1e-9 relative, anything else unequal."""
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
    return [] if want == got else [f"{path}: {want!r}, now {got!r}"]


@pytest.mark.parametrize("case", sorted(plan_golden.CASES))
def test_plan_unchanged(case):
    import json
    want = json.loads(GOLDEN.read_text())[case]
    got = json.loads(json.dumps(plan_golden.plan_case(case)))
    diffs = _diff(want, got)
    assert not diffs, f"{case}: the plan changed ({len(diffs)} differences):\n" + "\n".join(sorted(diffs)[:20])
