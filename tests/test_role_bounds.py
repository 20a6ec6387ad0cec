"""On a mesh of 3+ axes, "auto" searches one role assignment after another (planner._best). Each
assignment's fastest plan under no limit bounds what it can do under the limit, so the assignments are
searched under the limit from the lowest bound up and those the best plan so far beats are skipped:
this must find the plan the exhaustive search finds, with fewer searches."""
import json
import sys
import pathlib
import warnings

import autopar
from autopar.planning import planner
from autopar.search import ilp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import plan_golden  # noqa: E402


def _plan_and_searches(monkeypatch, exhaustive: bool):
    calls = []
    real = ilp._program
    # (roles, whether under the limit) of every ILP built
    monkeypatch.setattr(ilp, "_program", lambda *a, **k: calls.append((a[1].roles, a[2] is not None)) or real(*a, **k))
    if exhaustive:   # the search as before bounds: every assignment under the limit, in order
        monkeypatch.setattr(planner, "searches_free_first", lambda *a, **k: False)
    model, inputs = plan_golden._gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        # a limit some assignments' fastest plans exceed (measured: 6 searches under it for one
        # assignment, exhaustively; none when bounded: another's fastest plan fits and is faster)
        plan = autopar.plan(model, inputs, {"a": 2, "b": 2, "c": 2}, hardware="h100", memory_limit="0.9MB",
                            time_limit=None)
    d = json.loads(plan.to_json())
    d.pop("stats")
    return d, calls


def test_bounded_role_search_finds_the_exhaustive_plan_with_fewer_searches(monkeypatch):
    bounded, bounded_calls = _plan_and_searches(monkeypatch, exhaustive=False)
    monkeypatch.undo()
    exhaustive, exhaustive_calls = _plan_and_searches(monkeypatch, exhaustive=True)
    assert bounded == exhaustive
    assert any(limited for _, limited in exhaustive_calls)   # some assignment is searched under the limit
    assert len(bounded_calls) < len(exhaustive_calls), (len(bounded_calls), len(exhaustive_calls))
