"""The one module of autopar that touches private PyTorch APIs.

Everything here reaches into torch._C.* or torch.testing._internal.*, which
PyTorch may change in any release. Keeping it in one file means an upgrade
breaks one place; nothing else in autopar may import those modules directly.

- run_threaded: N ranks as N threads of this process, on torch's in-process
  "threaded" process group. Fast (no process start-up), good for tests.
- init_fake_process_group: a "fake" backend whose collectives do nothing, so
  a 1000-rank DeviceMesh can be built (and a plan traced) in one process.
- storage_id: which traced (fake) tensors share a storage.
"""

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# The threaded pg swaps module-level globals of torch.distributed (the "world")
# and ProcessLocalGroup keeps class-level state, so two runs must never overlap.
_threaded_lock = threading.Lock()
# Rank threads of an earlier run that did not stop (stuck outside any
# collective). They still see ProcessLocalGroup's class state, so no new run
# may start while they live.
_stragglers: list = []


# torch.export / make_fx keep module-level state (e.g. export's
# _EXPORT_MODULE_HIERARCHY) and fail with AssertionErrors when two threads trace
# at once. Hold this around any tracing that may run inside run_threaded ranks.
# Eager forward/backward in other threads while one traces is fine.
trace_lock = threading.RLock()


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
      trace at once: trace under trace_lock, or once before the call.
    Autograd's multithreading is disabled in the rank threads (as torch's own
    threaded tests do); CPU backward runs on the calling thread anyway.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg)

    with _threaded_lock:
        for t in _stragglers:
            t.join(timeout)
        if any(t.is_alive() for t in _stragglers):
            raise RuntimeError("run_threaded: rank threads of an earlier call are still "
                               "running (stuck outside a collective); cannot start another")
        _stragglers.clear()
        ProcessLocalGroup.reset()

        results = [None] * world_size
        failures = []  # (rank, exception), in the order they happened
        failures_lock = threading.Lock()
        run_over = threading.Event()
        store = _AbortableStore()

        def wake_all(exc):
            if not run_over.is_set():  # a late straggler must not disturb a later run
                store.abort()
                ProcessLocalGroup.exception_handle(exc)

        # Functional collectives (and so DTensor) resolve groups by name in a
        # C++ registry; isolation makes that registry per thread, like per process.
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = _install_threaded_pg()

        def worker(rank):
            try:
                # the timeout also bounds the store barriers of init and new_group
                dist.init_process_group(backend="threaded", rank=rank,
                                        world_size=world_size, store=store,
                                        timeout=timedelta(seconds=timeout))
                results[rank] = fn(rank, *args)
            except BaseException as e:
                # SystemExit is how a woken rank leaves a collective after
                # another rank failed: a consequence, not a cause.
                if not isinstance(e, SystemExit):
                    with failures_lock:
                        failures.append((rank, e))
                wake_all(e)
            finally:
                if dist.distributed_c10d._world is world and dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True,
                                    name=f"autopar-rank{r}")
                   for r in range(world_size)]
        hung = []
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                wake_all(TimeoutError())
                grace = time.monotonic() + 10.0
                for t in threads:
                    t.join(max(0.0, grace - time.monotonic()))
                _stragglers.extend(t for t in threads if t.is_alive())
        finally:
            run_over.set()
            if not _stragglers:
                ProcessLocalGroup.reset()
            _uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)

    if failures:
        rank, e = failures[0]
        others = sorted({r for r, _ in failures[1:]})
        also = f" (ranks {others} also raised)" if others else ""
        raise RankError(rank, f"rank {rank} of {world_size} raised "
                              f"{type(e).__name__}: {e}{also}") from e
    if hung:
        raise RankError(hung[0], f"ranks {hung} of {world_size} did not finish "
                                 f"within {timeout} s (deadlock in a collective?)")
    return results


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise the default process group on the "fake" backend.

    Collectives on it return at once and move no data (outputs keep whatever
    they held), so only shapes, ranks and group structure are meaningful:
    enough to build a DeviceMesh of any size and trace or plan with it in one
    process. Pair with destroy_process_group_if_initialized() when done.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group(backend="fake", rank=rank, world_size=world_size,
                            store=FakeStore())


def destroy_process_group_if_initialized() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def unflatten_outputs(exported, flat_outputs):
    """Rebuild the model's own output structure (tensor, tuple, dict...) from the graph's flat outputs."""
    import torch.utils._pytree as pytree
    return pytree.tree_unflatten(list(flat_outputs), exported.call_spec.out_spec)


def fake_mode_of(t: torch.Tensor):
    """The FakeTensorMode an exported graph's example values live in (to compute new nodes' values)."""
    return t.fake_mode


def symint_expr(s):
    """The sympy expression behind a torch.SymInt (export's symbolic dim), e.g. `s0` or `2*s0`."""
    return s.node.expr


def symint_hint(s) -> int:
    """The example value export traced a SymInt with."""
    return int(s.node.hint)


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage behind a tensor, fake ones included: views share it.

    Fake and meta tensors have no data pointer to compare; the storage's C++
    handle (what torch's own StorageWeakRef hashes) tells them apart. Valid
    while the tensors are alive (traced graphs keep theirs in node.meta).
    """
    return t.untyped_storage()._cdata
