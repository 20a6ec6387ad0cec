"""Random ops under a plan: one random stream per shard, one per replica.

On one device a dropout draws one mask for the whole tensor: the masks of head 0 and head h/2, or of batch
rows 0 and B/2, are independent draws. Run as traced, every rank draws its shard's mask from its own default
generator, and ranks seeded alike (the common case) draw the same numbers: every shard got the same mask.

The rewriter runs each op that draws random numbers (training dropout, attention with dropout_p, bernoulli,
rand, ...: sharding/local_ops.draws_random, which the plan records as LocalOp.random) through a `RandomOp`,
which puts the state of one stream into the default generator of the op's device while the op runs and takes
the advanced state back after (as Megatron's CUDA RNG tracker and DTensor's do; the aten dropout ops take no
generator argument, so only the default one reaches them). The stream is named by this rank's coordinates on
the mesh axes that split the op's output: ranks holding the same shard (differing only on axes where the
output is replicated) share a stream and draw the same numbers, one mask per replica; ranks holding different
shards, by head, hidden unit, sequence position or batch row, draw independent ones.

Why not draw the whole tensor's mask on every rank and keep this rank's slice (which would equal one device's
mask exactly)? Every rank would draw numbers for the whole tensor: over n data-parallel ranks n times what it
needs, and attention probabilities' whole mask is the largest tensor of a layer. A stream per shard costs what
the local op costs; its masks are independent draws of one device's distribution, not its very numbers.

Seeds: each stream starts from (base seed, its key). The base seed is mesh rank 0's, broadcast when the module
is made (`agreed_seed`), so ranks seeded differently, or not at all, still draw one mask per replica, and no
collective runs in forward; `ParallelModule.manual_seed` sets it. A checkpointed block reruns its ops in
backward from a snapshot of the streams taken before its forward (recompute.py), as torch.utils.checkpoint
does with the default generators, so the recompute draws forward's masks.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .._compat import generator_swap_lock

# Ranks run as threads of one process (autopar.testing.run_threaded) share the default generators: one swap at a
# time, or a rank would draw from another's stream; and none while another rank's torch.compile compiles a frame,
# which sets the default generators back to where they were when it began, perhaps in the middle of a swap
# (_compat.generator_swap_lock is the compiler's own lock). Uncontended in a process of its own.


def shard_key(axes: tuple, coords: tuple) -> tuple:
    """The stream an op draws from on this rank: (axis, coordinate) on each of `axes`, those that split its output
    (the plan records them: sharding/local_ops.random_axes); () (the one shared stream) for an output every rank
    holds whole."""
    return tuple((a, coords[a]) for a in axes)


def _stream_seed(base: int, key: tuple) -> int:
    """A seed per (base, key), the same in every process (Python's hash() of a str is salted per process)."""
    digest = hashlib.blake2b(repr((base, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # manual_seed takes up to 2**64 - 1; keep it positive int64


def _rng_state_access(device: torch.device):
    """(get, set) of the default generator's state on `device`, through torch's public per-device calls."""
    if device.type == "cpu":
        return torch.get_rng_state, torch.set_rng_state
    module = torch.get_device_module(device.type)
    return (lambda: module.get_rng_state(device)), (lambda state: module.set_rng_state(state, device))


class RandomStreams:
    """This rank's random streams: a generator state per (device, shard key), made on first use from the seed.

    States are replaced on every draw, never changed in place, so a shallow copy of the table is a snapshot."""

    def __init__(self, seed: int):
        self.seed = seed
        self._states: dict = {}

    def manual_seed(self, seed: int) -> None:
        """Start every stream again from `seed` (every rank must pass the same one)."""
        self.seed = seed
        self._states = {}

    def snapshot(self) -> dict:
        return dict(self._states)

    @contextmanager
    def replaying(self, snapshot: dict):
        """Draw from the streams as they were at `snapshot`; they are as before once the block ends."""
        now, self._states = self._states, dict(snapshot)
        try:
            yield
        finally:
            self._states = now

    def run(self, key: tuple, device: torch.device, fn):
        """fn() with the default generator of `device` drawing from stream `key`; that generator is left as it was."""
        get_state, set_state = _rng_state_access(device)
        with generator_swap_lock:
            own = get_state()
            set_state(self._state(key, device))
            try:
                out = fn()
                self._states[device, key] = get_state()
            finally:
                set_state(own)
        return out

    def _state(self, key: tuple, device: torch.device) -> torch.Tensor:
        if (device, key) not in self._states:
            g = torch.Generator(device=device)
            g.manual_seed(_stream_seed(self.seed, key))
            self._states[device, key] = g.get_state()
        return self._states[device, key]


def _device_of(args, kwargs) -> torch.device:
    """The device an op draws on: its first tensor's, else its `device=` (a factory), else the CPU."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


class RandomOp(torch.nn.Module):
    """One random op of the local graph, drawing from the stream of this rank's shard of its output."""

    def __init__(self, target, streams: RandomStreams, key: tuple, label: str):
        super().__init__()
        self.target, self.streams, self.key, self.label = target, streams, key, label

    # the generator swap is Python state torch.compile cannot trace: the graph breaks here and the op runs eagerly
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        return self.streams.run(self.key, _device_of(args, kwargs), lambda: self.target(*args, **kwargs))

    def extra_repr(self) -> str:
        return self.label


def agreed_seed(axes: list, device: torch.device) -> int:
    """A base seed every rank of the mesh holds: one made from mesh rank 0's default generator state (read, not
    advanced), broadcast along each axis in turn (after axis a, every rank holds that of coordinate 0 on axes
    0..a)."""
    state = torch.get_rng_state().numpy().tobytes()
    seed = int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 1
    t = torch.tensor([seed], dtype=torch.int64, device=device)
    for ax in axes:
        if ax.size > 1:
            dist.broadcast(t, src=dist.get_global_rank(ax.group, 0), group=ax.group)
    return int(t.item())
