"""run_threaded: N ranks as N threads of this process, on torch's in-process "threaded" process group.

Fast (no process start-up), so it is the workhorse of the test suite. The
private torch API it drives stays behind small functions in autopar._compat.
"""

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .._compat import (current_world, destroy_threaded_group, install_threaded_pg, reset_threaded_pg,
                       uninstall_threaded_pg, wake_threaded_ranks)

__all__ = ["RankError", "run_threaded"]

# The threaded pg swaps module-level globals of torch.distributed (the "world")
# and ProcessLocalGroup keeps class-level state, so two runs must never overlap.
_threaded_lock = threading.Lock()
# Rank threads of an earlier run that did not stop (stuck outside any
# collective). They still see ProcessLocalGroup's class state, so no new run
# may start while they live.
_stragglers: list = []


class RankError(RuntimeError):
    """A rank of a multi-rank run raised; `.rank` says which, `__cause__` what."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class _AbortableStore(dist.Store):
    """A HashStore whose blocking waits end (SystemExit) once abort() is called.

    ProcessLocalGroup.exception_handle only wakes ranks blocked in a
    collective. Ranks blocked in the store barrier of init_process_group or
    new_group (DeviceMesh creation) wait on the store instead; without this
    they would sit there for the whole timeout after another rank failed.
    """

    def __init__(self):
        super().__init__()
        self._inner = dist.HashStore()
        self._aborted = threading.Event()

    def abort(self):
        self._aborted.set()

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + (timeout or self._inner.timeout).total_seconds()
        while not self._aborted.is_set():
            try:
                # short slices so an abort is seen within 50 ms
                return self._inner.wait(keys, timedelta(milliseconds=50))
            except dist.DistStoreError:
                if time.monotonic() > deadline:
                    raise
        # SystemExit, like ProcessLocalGroup's own wake-up: "not the cause"
        raise SystemExit("run_threaded: aborted because another rank failed")

    def get(self, key):
        self.wait([key])
        return self._inner.get(key)

    def set(self, key, value):
        self._inner.set(key, value)

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self._inner.check(keys)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()


def run_threaded(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """Run fn(rank, *args) on world_size threads, each a rank of a threaded process group.

    Returns the return values in rank order. If a rank raises, the others are
    woken out of any collective or group creation they wait in, and RankError
    is raised for the first rank that failed (the original exception is its
    __cause__). If the run takes longer than timeout seconds, RankError too.

    Threads share one process, so fn must not rely on per-rank global state:
    - the CPU RNG is shared: torch.manual_seed in one thread reseeds all of
      them and concurrent random ops interleave, so build seeded models before
      the call (and deepcopy them in fn), never seed inside fn;
    - torch.export / make_fx keep module-level state and fail when two ranks
      trace at once: trace under autopar._compat.trace_lock, or once before the call.
    Autograd's multithreading is disabled in the rank threads (as torch's own
    threaded tests do); CPU backward runs on the calling thread anyway.
    """
    with _threaded_lock:
        _wait_for_stragglers(timeout)
        reset_threaded_pg()
        run = _ThreadedRun(world_size, fn, args, timeout)
        hung = run.start_and_join()
    _raise_if_failed(run.failures, hung, world_size, timeout)
    return run.results


def _wait_for_stragglers(timeout: float) -> None:
    """Give the stuck threads of earlier runs `timeout` s to end; refuse to start while any lives."""
    for t in _stragglers:
        t.join(timeout)
    if any(t.is_alive() for t in _stragglers):
        raise RuntimeError("run_threaded: rank threads of an earlier call are still "
                           "running (stuck outside a collective); cannot start another")
    _stragglers.clear()


class _ThreadedRun:
    """One run_threaded call: the state its rank threads share, and the threads' life cycle."""

    def __init__(self, world_size: int, fn, args: tuple, timeout: float):
        self.world_size, self.fn, self.args, self.timeout = world_size, fn, args, timeout
        self.results = [None] * world_size
        self.failures = []  # (rank, exception), in the order they happened
        self._failures_lock = threading.Lock()
        self._over = threading.Event()
        self._store = _AbortableStore()
        self._world = None  # the threaded pg's world, once installed

    def wake_all(self, exc: BaseException) -> None:
        """Wake every rank out of the collective or store barrier it waits in (a rank failed, or time ran out)."""
        if not self._over.is_set():  # a late straggler must not disturb a later run
            self._store.abort()
            wake_threaded_ranks(exc)

    def worker(self, rank: int) -> None:
        """One rank's thread: join the process group, run fn, keep its result or its exception."""
        try:
            # the timeout also bounds the store barriers of init and new_group
            dist.init_process_group(backend="threaded", rank=rank,
                                    world_size=self.world_size, store=self._store,
                                    timeout=timedelta(seconds=self.timeout))
            self.results[rank] = self.fn(rank, *self.args)
        except BaseException as e:
            # SystemExit is how a woken rank leaves a collective after
            # another rank failed: a consequence, not a cause.
            if not isinstance(e, SystemExit):
                with self._failures_lock:
                    self.failures.append((rank, e))
            self.wake_all(e)
        finally:
            if current_world() is self._world and dist.is_initialized():
                destroy_threaded_group()

    def start_and_join(self) -> list:
        """Run the rank threads on a freshly installed threaded pg and uninstall it after; returns the hung ranks."""
        self._world = install_threaded_pg()
        threads = [threading.Thread(target=self.worker, args=(r,), daemon=True,
                                    name=f"autopar-rank{r}")
                   for r in range(self.world_size)]
        hung = []
        try:
            for t in threads:
                t.start()
            hung = self._join(threads)
        finally:
            self._over.set()
            if not _stragglers:
                reset_threaded_pg()
            uninstall_threaded_pg()
        return hung

    def _join(self, threads: list) -> list:
        """Wait out the timeout; wake ranks still running, keep those that outlive a grace period as stragglers."""
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            self.wake_all(TimeoutError())
            grace = time.monotonic() + 10.0
            for t in threads:
                t.join(max(0.0, grace - time.monotonic()))
            _stragglers.extend(t for t in threads if t.is_alive())
        return hung


def _raise_if_failed(failures: list, hung: list, world_size: int, timeout: float) -> None:
    """RankError for the first rank that raised, else for the ranks that hung; nothing if all finished."""
    if failures:
        rank, e = failures[0]
        others = sorted({r for r, _ in failures[1:]})
        also = f" (ranks {others} also raised)" if others else ""
        raise RankError(rank, f"rank {rank} of {world_size} raised "
                              f"{type(e).__name__}: {e}{also}") from e
    if hung:
        raise RankError(hung[0], f"ranks {hung} of {world_size} did not finish "
                                 f"within {timeout} s (deadlock in a collective?)")
