"""The disk cache of HiGHS's answers (autopar/search/solve_cache.py): a plan made again from the
cache is the plan HiGHS gave, without HiGHS; another program is a miss; what HiGHS did not finish is
never kept; a damaged entry is a miss and is rewritten; the switch turns it off."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.optimize import OptimizeResult

import autopar
from autopar.search import ilp, solve_cache
from autopar.testing import GPT, GPTConfig

MESH = {"a": 2, "b": 2}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own, and a count of HiGHS's runs (branch and bound, or a relaxation)."""
    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE", "1")
    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE_DIR", str(tmp_path))
    runs = []
    real_milp, real_linprog = ilp.milp, ilp.linprog   # a search solves its program's relaxation first
    monkeypatch.setattr(ilp, "milp", lambda *a, **k: runs.append(1) or real_milp(*a, **k))
    monkeypatch.setattr(ilp, "linprog", lambda *a, **k: runs.append(1) or real_linprog(*a, **k))
    return tmp_path, runs


def _plan(hardware="cpu"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    return autopar.plan(model, (torch.randint(0, 32, (8, 8)),), MESH, hardware=hardware)


def _without_timings(plan) -> dict:
    d = json.loads(plan.to_json())
    d["stats"] = {k: v for k, v in d["stats"].items() if not k.endswith("_seconds") or k == "objective_seconds"}
    return d


def test_a_plan_made_again_comes_from_the_cache_and_is_the_same(cache):
    where, runs = cache
    first = _plan()
    solved = len(runs)
    assert solved >= 1 and len(list(where.glob("*.npz"))) == solved   # every finished answer kept
    again = _plan()
    assert len(runs) == solved                                         # HiGHS not run again
    assert _without_timings(again) == _without_timings(first)
    _plan(hardware="h100")                                             # another program (prices): solved
    assert len(runs) > solved


def test_the_key_is_the_program_not_the_order_its_entries_came_in():
    A = sp.csr_array((np.array([1.0, 2.0, 3.0]), (np.array([0, 1, 0]), np.array([2, 0, 1]))), shape=(2, 3))
    B = sp.csr_array((np.array([3.0, 1.0, 2.0]), (np.array([0, 0, 1]), np.array([1, 2, 0]))), shape=(2, 3))
    args = (np.ones(3), np.ones(3), np.zeros(3), np.ones(3))
    rows = (np.zeros(2), np.ones(2))
    key = solve_cache.program_key(*args, A, *rows, {"mip_rel_gap": 1e-3})
    assert key == solve_cache.program_key(*args, B, *rows, {"mip_rel_gap": 1e-3})
    C = A.copy()
    C.data[0] = 1.5
    assert key != solve_cache.program_key(*args, C, *rows, {"mip_rel_gap": 1e-3})      # a coefficient
    assert key != solve_cache.program_key(*args, A, *rows, {"mip_rel_gap": 1e-4})      # an option
    assert key != solve_cache.program_key(np.ones(3), np.ones(3), np.zeros(3), np.full(3, 2.0), A, *rows,
                                          {"mip_rel_gap": 1e-3})                      # a bound


def test_an_answer_cut_short_by_the_clock_is_not_kept(cache, monkeypatch):
    where, _ = cache
    stopped = lambda *a, **k: OptimizeResult(   # noqa: E731
        x=None, fun=None, status=1, success=False, message="Time limit reached.", mip_dual_bound=None, mip_gap=None)
    monkeypatch.setattr(ilp, "milp", stopped)
    monkeypatch.setattr(ilp, "linprog", stopped)   # the relaxation, solved first
    _plan()   # the greedy's plan
    assert not list(where.glob("*.npz"))


def _flip_a_bit_in_the_data(data: bytes) -> bytes:
    """One bit flipped in the middle of the first member's compressed data ("format", which every load reads),
    so zlib or the member's CRC meets it (a bit in a zip header, or in a member a load skips, would go unseen)."""
    member = zipfile.ZipFile(io.BytesIO(data)).infolist()[0]
    start = member.header_offset + 30 + len(member.filename) + int.from_bytes(data[member.header_offset + 28:
                                                                                    member.header_offset + 30], "little")
    at = start + member.compress_size // 2
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


# each was seen raising out of planning (EOFError, zipfile.BadZipFile, zlib.error) until the entry was deleted
DAMAGES = {"foreign": lambda data: b"not an npz", "empty": lambda data: b"",
           "truncated": lambda data: data[: len(data) // 2], "bit flipped": _flip_a_bit_in_the_data}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_a_miss_and_is_rewritten(cache, damage):
    where, runs = cache
    first = _plan()
    for entry in where.glob("*.npz"):
        entry.write_bytes(DAMAGES[damage](entry.read_bytes()))
    solved = len(runs)
    again = _plan()
    assert len(runs) == 2 * solved
    assert _without_timings(again) == _without_timings(first)
    assert all(np.load(e)["format"] == solve_cache.FORMAT for e in where.glob("*.npz"))


def test_the_switch_turns_it_off(cache, monkeypatch):
    where, runs = cache
    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE", "0")
    _plan()
    solved = len(runs)
    _plan()
    assert solved >= 1 and len(runs) == 2 * solved   # HiGHS ran again for every program
    assert not list(where.glob("*.npz"))
