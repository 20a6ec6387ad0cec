"""A disk cache of HiGHS's answers, keyed by the integer program itself.

Planning one model on one mesh with the same options builds the same integer programs every time:
`parallelize` at every launch of a training script, `autopar plan` and then `parallelize`, a test
suite planning one toy model in many files. HiGHS takes most of a plan's time, so its answers are
kept on disk, as capture/cache.py keeps traced layers.

Why it is safe: the key is a SHA-256 of everything `scipy.optimize.milp` (or, for a program's
relaxation, `linprog`) reads -- the objective, the
integrality, the variables' bounds, the constraint matrix (in canonical CSR form) and its row bounds,
the options -- and the version of scipy, which ships HiGHS. A hit is an answer HiGHS gave to this very
program. Only answers HiGHS finished are kept (an optimum within the gap asked for, or a proof of
infeasibility): one cut short by the time limit says how far the clock let it get, not what the
program's answer is. A finished answer can still depend on the clock when a time limit is set (HiGHS
then rations its effort by time: of two equally cheap plans it may return either, by the machine's
load); the cache returns the first one it saw, so a plan made again is the same plan.

Where: $AUTOPAR_SOLVE_CACHE_DIR, else ~/.cache/autopar/solves; AUTOPAR_SOLVE_CACHE=0 turns it off.
Writes are atomic (a temporary file renamed into place); an unreadable entry (empty, truncated, a bit
flipped: whatever numpy or zlib raises on it) is a miss, and the answer HiGHS then gives replaces it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import tempfile
from types import SimpleNamespace

import numpy as np
import scipy

log = logging.getLogger(__name__)

FORMAT = 1          # of the stored entries
_FINISHED = (0, 2)  # milp's status: 0 optimal (within the gap), 2 infeasible


def cache_dir() -> pathlib.Path | None:
    """Where answers go, None when the cache is off."""
    if os.environ.get("AUTOPAR_SOLVE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    where = os.environ.get("AUTOPAR_SOLVE_CACHE_DIR")
    return pathlib.Path(where) if where else pathlib.Path.home() / ".cache" / "autopar" / "solves"


def program_key(c, integrality, lower, upper, A, row_lower, row_upper, options: dict) -> str:
    """The SHA-256 of a program as milp reads it. `A` is a scipy sparse matrix; it is hashed in
    canonical CSR form (sorted indices, duplicates summed), so the order its entries were added in
    does not change the key."""
    A = A.tocsr(copy=True)
    A.sum_duplicates()
    A.sort_indices()
    h = hashlib.sha256(repr((FORMAT, scipy.__version__, A.shape, sorted(options.items()))).encode())
    for array, dtype in ((c, float), (integrality, np.int8), (lower, float), (upper, float),
                         (A.indptr, np.int64), (A.indices, np.int64), (A.data, float),
                         (row_lower, float), (row_upper, float)):
        h.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
        h.update(b"|")
    return h.hexdigest()


def load(key: str):
    """The stored answer to the program `key` names, as milp returns one (x, fun, status, message,
    mip_gap, mip_dual_bound; and for a relaxation, its reduced costs), or None."""
    directory = cache_dir()
    if directory is None:
        return None
    path = directory / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as entry:
            if int(entry["format"]) != FORMAT:
                return None
            x = entry["x"] if bool(entry["has_x"]) else None
            res = SimpleNamespace(x=x, fun=float(entry["fun"]) if x is not None else None,
                                  status=int(entry["status"]), message=str(entry["message"]),
                                  mip_gap=float(entry["mip_gap"]), mip_dual_bound=float(entry["mip_dual_bound"]))
            if "reduced_at_lower" in entry.files:   # a relaxation's answer (search/ilp.py's _ILP.relax)
                res.reduced_at_lower, res.reduced_at_upper = entry["reduced_at_lower"], entry["reduced_at_upper"]
    except FileNotFoundError:
        return None
    except Exception as e:   # empty, truncated, a flipped bit (EOFError, BadZipFile, zlib.error, ...): a miss,
        log.debug("solve cache: unreadable entry %s (%s)", path, e)   # and store() writes it anew
        return None
    log.debug("solve cache: hit %s", path)
    return res


def store(key: str, res) -> None:
    """Keep `res` (milp's answer, or a relaxation's with its reduced costs) under `key` where HiGHS finished; any error writing is ignored (the
    cache only saves time)."""
    directory = cache_dir()
    if directory is None or int(res.status) not in _FINISHED:
        return
    x = getattr(res, "x", None)
    fields = dict(format=FORMAT, has_x=x is not None, x=np.asarray(x if x is not None else [], dtype=float),
                  fun=float(res.fun) if x is not None and res.fun is not None else np.nan,
                  status=int(res.status), message=str(res.message),
                  mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0),
                  mip_dual_bound=float(getattr(res, "mip_dual_bound", np.nan) if
                                       getattr(res, "mip_dual_bound", None) is not None else np.nan))
    if getattr(res, "reduced_at_lower", None) is not None:
        fields.update(reduced_at_lower=np.asarray(res.reduced_at_lower, dtype=float),
                      reduced_at_upper=np.asarray(res.reduced_at_upper, dtype=float))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **fields)
        os.replace(tmp, directory / f"{key}.npz")
    except OSError as e:
        log.debug("solve cache: not stored (%s)", e)
