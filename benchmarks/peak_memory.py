"""Per-rank peak memory while a meta-built GPT is parallelized, loaded from a checkpoint and trained.

    python benchmarks/peak_memory.py                                   # 4 CPU ranks (gloo), FSDP; ~40 s on 2 cores
    python benchmarks/peak_memory.py --n-layer 24 --vocab-size 2048 --per-rank
    python benchmarks/peak_memory.py --stacks                          # Python frames of what is live at each peak
    python benchmarks/peak_memory.py --device cuda                     # NCCL, one GPU per rank

The promise checked: a model built on the meta device and parallelized holds only this rank's
shards; while building or loading, no rank holds more than its shards plus one layer's whole
weights, and while training no more than the plan predicts. The parent process writes a checkpoint
of the whole model once, as a single-device user would (`dcp.save(..., no_dist=True)`; it is not
measured), then `--world` real processes each run

    with torch.device("meta"): model = GPT(cfg)
    pm = autopar.parallelize(model, mesh, (x,), strategy=...)                    # build
    pm.to_empty(device=...); sd = pm.state_dict(); dcp.load(sd, checkpoint_id=path)
    pm.load_state_dict(sd)                                                       # load: dcp.load
    autopar.checkpoint.load(path, pm)                                            # load: autopar
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=...)
    loss = gpt_loss(pm(*local_x), *local_y); loss.backward(); opt.step()         # train step 1, 2, ...

How it is measured. CPU (default): torch's CPU allocator keeps a running count of the bytes it has
handed out and not taken back; each rank makes it count on every thread from its first line on
(track_frees_on_all_threads), and a `torch.profiler.profile(profile_memory=True)` session records
every allocation and free with the count after it. A phase's peak is the highest count between the
phase's start and end, so what earlier phases left alive (the shards, the optimizer state) is in
it. The allocations live at each peak are replayed from the events and listed, summed by the op
(with --stacks, also the Python frames) that made them. Not counted: memory torch's allocator does
not hand out (gloo's own buffers, Python objects, the profiler's records). check_measurement runs
first on allocations of known size, a free on another thread among them, and stops the run if the
numbers are off. "RSS rise" is the process's resident high-water mark during the phase minus its
resident size at the start (the mark is reset per phase through /proc/self/clear_refs): it sees
everything, Python objects, the profiler's records and malloc's caching included, so it is coarse.
CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()` at each phase's start.

Columns, one row per phase: the rank closest to its bound (--per-rank: every rank), its peak, the
whole model's parameter bytes, its shard (`pm.parameters()`), one layer's whole weights (the
biggest of the blocks, the embeddings and the head), the bound (shard + layer for build and load,
`plan.predicted.memory.total` for a train step, whose parts are printed below the table), the
margin (bound - peak) and whether the peak stays within the bound. The world size caps the ratio
of the whole model to shard + layer below `--world` (a shard is 1/world of the model). Kineto
prints two "USDT ... profiler_start/stop" lines per session on stderr. A measurement, so a
benchmark, not a test.
"""
import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings

# before torch loads: its CPU allocator warns (once) about frees of blocks allocated before it counted
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import autopar  # noqa: E402
from autopar._compat import profiler_event_types  # noqa: E402
from autopar.testing import GPT, GPTConfig, gpt_loss  # noqa: E402
from autopar.testing.harness import free_port  # noqa: E402

MiB = 1024 * 1024
MARK = "peak_memory::"      # record_function names of the phases
TOP = 10                    # groups of allocations listed per peak
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(autopar.__file__))) + os.sep   # left off file names


# ----------------------------------------------------------------------------- the CPU allocator's count

def track_frees_on_all_threads() -> bool:
    """Make torch's CPU allocator count every allocation and free, on any thread, from now on.

    By default it counts only on threads being profiled, so a tensor that gloo's worker thread drops
    last (a collective's input, often) stays counted forever and the running total creeps up. Its flag
    `caffe2_report_cpu_memory_usage` (a c10 global, no Python API) makes it count everywhere; its log
    lines are INFO, below the default level. False where the symbol is missing.
    """
    import ctypes
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
        return True
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- sizes

def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def model_sizes(cfg: GPTConfig) -> dict:
    """Whole-model and per-layer parameter bytes (on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(cfg)
    units = {"wte": model.wte, "wpe": model.wpe, "ln_f": model.ln_f, "lm_head": model.lm_head,
             **{f"h.{i}": b for i, b in enumerate(model.h)}}
    unit_bytes = {k: _nbytes(m.parameters()) for k, m in units.items()}
    # one layer: a transformer block, the token or position embedding, or the head, whichever is biggest
    block = max(unit_bytes, key=unit_bytes.get)
    biggest_param = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    return {"whole": _nbytes(model.parameters()), "layer": unit_bytes[block], "layer_name": block,
            "units": unit_bytes, "biggest_param": (biggest_param[0], _nbytes([biggest_param[1]]))}


# ----------------------------------------------------------------------------- one rank

def _rss_reset() -> int | None:
    """Reset the resident high-water mark to the current resident size; that size in bytes, or None
    where /proc cannot do it (not Linux): the RSS column then says n/a rather than a rise since start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"no {key} in /proc/self/status")


class _Phases:
    """Marks phases for the profiler (CPU) or resets CUDA's peak (CUDA), and reads the RSS high-water mark."""

    def __init__(self, cuda: bool):
        self.cuda, self.rows, self._rf = cuda, [], None

    def start(self, name: str):
        self.name = name
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_start = torch.cuda.memory_allocated()
        self.rss_start = _rss_reset()
        self._rf = torch.profiler.record_function(MARK + name)
        self._rf.__enter__()
        torch.empty(1, dtype=torch.uint8)   # an event, so the count at the phase's start is known
        self.t0 = time.perf_counter()

    def stop(self):
        self._rf.__exit__(None, None, None)
        row = {"phase": self.name, "seconds": time.perf_counter() - self.t0,
               "rss_rise": None if self.rss_start is None else _status_kib("VmHWM") * 1024 - self.rss_start}
        if self.cuda:
            torch.cuda.synchronize()
            row.update(cuda_start=self.cuda_start, peak=torch.cuda.max_memory_allocated())
        self.rows.append(row)


def _where(event, stacks: bool) -> str:
    """The op that allocated (and the innermost user-level Python frames, with --stacks), innermost first."""
    ops, frames, e = [], [], event.parent
    while e is not None:
        name = e.name
        if name.startswith(MARK):
            break
        if e.tag == profiler_event_types().TorchOp:
            if len(ops) < 2:
                ops.append(name)
        elif stacks and e.tag == profiler_event_types().PyCall:
            if ("autopar" in name or "distributed/checkpoint" in name or "torch/optim" in name
                    or "peak_memory.py" in name) and len(frames) < 4:
                frames.append(name.split("site-packages/")[-1].replace(ROOT, ""))
        e = e.parent
    return " < ".join(ops + frames) or "(outside any op)"


def _walk(roots):
    stack = list(roots)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def _session_events(prof, stacks: bool, events: list, windows: dict) -> None:
    """Append a finished profiler session's CPU allocation events, as (time, bytes (< 0: a free), running total,
    address, where), and its phase windows (read at once: a later session may invalidate the records)."""
    ET = profiler_event_types()
    for e in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if e.tag == ET.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                events.append((e.start_time_ns, f.alloc_size, f.total_allocated, f.ptr,
                               _where(e, stacks) if f.alloc_size > 0 else None))
        elif e.tag == ET.TorchOp and e.name.startswith(MARK):
            windows[e.name[len(MARK):]] = (e.start_time_ns, e.end_time_ns)


def _analyse(events: list, windows: dict, phases: list) -> None:
    """Per phase: live bytes at its start, its peak, and what is live at the peak."""
    events.sort(key=lambda t: t[0])
    targets = {}   # event index of each phase's peak -> its row
    for row in phases:
        lo, hi = windows[row["phase"]]
        inside = [i for i, ev in enumerate(events) if lo <= ev[0] <= hi]
        before = [i for i, ev in enumerate(events) if ev[0] < lo]
        # the count just before the phase's first event (_Phases.start makes one)
        start = (events[inside[0]][2] - events[inside[0]][1] if inside
                 else events[before[-1]][2] if before else 0)
        peak_i = max(inside, key=lambda i: events[i][2], default=None)
        row["start"] = start
        row["peak"] = max(start, events[peak_i][2]) if peak_i is not None else start
        row["live_at_peak"], row["live_count"] = [], 0
        if peak_i is not None and events[peak_i][2] >= start:
            targets[peak_i] = row
    # Which allocations are live: replayed from the events. A free on an unprofiled thread (gloo's) has no
    # event, so such an allocation stays in `live` until its address is reused; the allocator's count (the
    # peak) is exact, and what the replay holds beyond it is listed as freed elsewhere.
    live = {}
    for i, (t, size, total, ptr, where) in enumerate(events):
        if size > 0:
            live[ptr] = (size, t, where)   # replaces one at this address that was freed unseen
        else:
            live.pop(ptr, None)
        if i in targets:
            targets[i]["live_at_peak"] = _group(live.values(), windows)
            targets[i]["live_count"] = len(live)
            targets[i]["unseen_frees"] = max(0, sum(v[0] for v in live.values()) - total)


def _group(allocations, windows: dict) -> list:
    """Live allocations summed by (phase that made them, where): [(bytes, count, phase, where)], biggest first."""
    groups = {}
    for size, t, where in allocations:
        key = (next((p for p, (lo, hi) in windows.items() if lo <= t <= hi), "-"), where)
        total, count = groups.get(key, (0, 0))
        groups[key] = (total + size, count + 1)
    return sorted(((b, n, *key) for key, (b, n) in groups.items()), key=lambda t: -t[0])[:TOP]


def _rank(rank: int, world: int, cfg: GPTConfig, strategy: str, device: str, ckpt: str, batch: int,
          steps: int, lr: float, hardware, stacks: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device == "cuda"
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    if cuda:
        x, y = x.cuda(), y.cuda()
    phases = _Phases(cuda)
    profs, events, windows = [], [], {}

    def profile(with_stack: bool):
        if not cuda:
            profs.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True, with_stack=with_stack))
            profs[-1].__enter__()

    def stop_profile():
        if profs:
            profs[-1].__exit__(None, None, None)
            _session_events(profs.pop(), stacks, events, windows)

    # Python stacks while torch.export traces (build) take more memory than 4 ranks have here: with --stacks
    # build runs in a session without them. The allocator's running total carries over between sessions.
    profile(with_stack=False)
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    kwargs = {"strategy": strategy} if hardware is None else {"strategy": strategy, "hardware": hardware}

    phases.start("build")
    with torch.device("meta"):
        model = GPT(cfg)
    pm = autopar.parallelize(model, mesh, (x,), **kwargs)
    on_meta = all(p.is_meta for p in pm.parameters())
    phases.stop()
    if stacks and not cuda:
        stop_profile()
        profile(with_stack=True)

    phases.start("load: dcp.load")
    pm.to_empty(device=device)
    sd = pm.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)   # the standard round trip
    pm.load_state_dict(sd)
    del sd
    phases.stop()
    phases.start("load: autopar")
    autopar.checkpoint.load(ckpt, pm)   # the same, one whole tensor at a time at most
    phases.stop()

    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=lr)
    losses = []
    for step in range(steps):
        phases.start(f"train step {step + 1}")
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(pm(local_x), local_y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        del loss
        phases.stop()

    if not cuda:
        stop_profile()
        _analyse(events, windows, phases.rows)
    m = pm.plan.predicted.memory
    return {"rows": phases.rows, "shard": _nbytes(pm.parameters()), "losses": losses,
            "on_meta_after_build": on_meta,
            "predicted": {k: float(getattr(m, k)) for k in
                          ("params", "master", "grads", "optimizer", "activations", "transient", "total")}}


def check_measurement() -> None:
    """The measurement on allocations of known size: a phase's peak counts what earlier phases left alive,
    and a free on another thread counts when it happens."""
    import threading

    held = torch.empty(1000)   # before the allocator counts: its free is not counted either
    if not track_frees_on_all_threads():
        warnings.warn("cannot make torch's CPU allocator count frees on other threads: the peaks may be high")
    phases = _Phases(cuda=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        phases.start("a")
        a = torch.empty(1_000_000)              # 4 MB
        b = torch.ones(250_000)                 # 1 MB, kept into phase b: peak 5 MB
        del a
        c = [torch.empty(500_000)]              # 2 MB, 3 MB live at the end
        phases.stop()
        phases.start("b")                       # starts at 3 MB
        del held
        freer = threading.Thread(target=c.clear)   # 1 MB after another thread frees c
        freer.start()
        freer.join()
        d = b.repeat(3)                         # 3 MB
        e = torch.empty_like(d)                 # 3 MB more: peak 1 + 3 + 3 MB
        del d, e
        phases.stop()
    events, windows = [], {}
    _session_events(prof, False, events, windows)
    _analyse(events, windows, phases.rows)
    base = phases.rows[0]["start"]
    got = {r["phase"]: (r["start"] - base, r["peak"] - base) for r in phases.rows}
    want = {"a": (0, 5_000_000), "b": (3_000_000, 7_000_000)}
    if got != want:
        raise AssertionError(f"profiler memory measurement is off: got {got}, want {want} (bytes above the start)")
    del b


# ----------------------------------------------------------------------------- processes

def _worker(rank, world, port, backend, out_dir, args):
    torch.set_num_threads(1)
    if backend == "gloo" and not track_frees_on_all_threads():
        warnings.warn("cannot make torch's CPU allocator count frees on other threads: the peaks may be high")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = _rank(rank, world, *args)
        dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(world: int, backend: str, args: tuple, timeout: float) -> list:
    """`world` spawned processes joined by `backend`, each running _rank; their results in rank order."""
    env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "KINETO_LOG_LEVEL": "5"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)   # the children read these when they import torch
    with tempfile.TemporaryDirectory(prefix="peak_memory_") as out_dir:
        try:
            ctx = mp.start_processes(_worker, args=(world, free_port(), backend, out_dir, args), nprocs=world,
                                     join=False, start_method="spawn")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
        except mp.ProcessRaisedException:
            errs = sorted(n for n in os.listdir(out_dir) if n.endswith(".err"))
            tb = open(os.path.join(out_dir, errs[0])).read() if errs else ""
            raise RuntimeError(f"a rank failed ({', '.join(errs) or 'no traceback written'}):\n{tb}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ----------------------------------------------------------------------------- report

def _mib(b) -> str:
    return f"{b / MiB:.2f}"


def add_bounds(results: list, sizes: dict) -> None:
    """Each row's bound: shard + one layer (build, load) above what was live before the build (the rank's
    batch), the plan's predicted total (a train step)."""
    for res in results:
        before = res["rows"][0]["start"]
        for row in res["rows"]:
            if row["phase"].startswith("train"):
                row["bound"], row["bound_is"] = res["predicted"]["total"], "predicted total"
            else:
                row["bound"], row["bound_is"] = before + res["shard"] + sizes["layer"], "batch+shard+layer"


def _shown(results: list, i: int, per_rank: bool):
    """Every rank, or the one whose peak in phase i comes closest to (or goes furthest over) its bound."""
    if per_rank:
        return range(len(results))
    return [min(range(len(results)), key=lambda r: results[r]["rows"][i]["bound"] - results[r]["rows"][i]["peak"])]


# torch's own round trip: its filesystem reader holds two whole tensors at once (the docstring's "dcp.load");
# every other phase's bound is a promise autopar makes, and the exit status says whether it held
UNPROMISED = ("load: dcp.load",)


def print_table(results: list, sizes: dict, per_rank: bool) -> bool:
    """The table; whether every phase autopar promises a bound for stayed within it."""
    header = (f"{'phase':<15} {'rank':>4} {'peak':>8} {'RSS rise':>9} {'whole':>7} {'shard':>7} {'layer':>6} "
              f"{'bound':>8} {'bound is':<17} {'margin':>7} {'within':>6}")
    print("MiB per rank" + ("" if per_rank else "; the rank closest to its bound") + "\n" + header)
    print("-" * len(header))
    for i, name in enumerate(row["phase"] for row in results[0]["rows"]):
        for r in _shown(results, i, per_rank):
            res, row = results[r], results[r]["rows"][i]
            print(f"{name:<15} {r:>4} {_mib(row['peak']):>8} {'n/a' if row['rss_rise'] is None else _mib(row['rss_rise']):>9} {_mib(sizes['whole']):>7} "
                  f"{_mib(res['shard']):>7} {_mib(sizes['layer']):>6} {_mib(row['bound']):>8} {row['bound_is']:<17} "
                  f"{_mib(row['bound'] - row['peak']):>7} {'yes' if row['peak'] <= row['bound'] else 'NO':>6}")
    p = results[0]["predicted"]
    print("\nprediction per rank (plan.predicted.memory, MiB): " + ", ".join(
        f"{k} {_mib(p[k])}" for k in ("params", "master", "grads", "optimizer", "activations", "transient", "total")
        if k != "master" or p[k]))
    return all(row["peak"] <= row["bound"] for res in results for row in res["rows"] if row["phase"] not in UNPROMISED)


def print_peaks(results: list, per_rank: bool):
    """What is live at each phase's peak, grouped by where it was made (CPU only)."""
    print("\nwhat is live at each peak, summed by where it was made (MiB, count, phase, op < Python frames):")
    for i, name in enumerate(row["phase"] for row in results[0]["rows"]):
        for r in _shown(results, i, per_rank):
            row = results[r]["rows"][i]
            print(f"  {name}, rank {r}: peak {_mib(row['peak'])} MiB, {_mib(row['start'])} MiB live at the "
                  f"phase's start, {row.get('live_count', 0)} allocations live at the peak")
            for size, count, made_in, where in row.get("live_at_peak", []):
                print(f"    {_mib(size):>7} {count:>5}  {made_in:<13} {where}")
            if row.get("unseen_frees"):
                print(f"    {_mib(-row['unseen_frees']):>7}        (freed on gloo's threads, unseen: the replay "
                      f"cannot tell which of the above)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks, one process each (default: 4)")
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64, help="sequence length of the batch too")
    p.add_argument("--batch", type=int, default=8, help="global batch (default: 8)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--strategy", default="fsdp", help="on a 1-D mesh named dp (default: fsdp)")
    p.add_argument("--steps", type=int, default=2, help="training steps, one row each (default: 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: gloo, profiler memory events; cuda: nccl, max_memory_allocated (default: cpu)")
    p.add_argument("--hardware", default=None, help="autopar hardware preset (default: autopar's for the mesh)")
    p.add_argument("--per-rank", action="store_true", help="a row per rank (default: the rank closest to its bound)")
    p.add_argument("--stacks", action="store_true", help="record Python stacks of allocations (slower)")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--device cuda: {args.world} ranks need {args.world} GPUs, found {torch.cuda.device_count()}")
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, bias=args.bias)
    sizes = model_sizes(cfg)
    if args.device == "cpu":
        check_measurement()   # raises unless known allocations measure right
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peak_memory_ckpt_") as ckpt:
        torch.manual_seed(0)   # the single-device user writes the whole model once; this process is not measured
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # dcp.save without a process group says it assumes one
            dcp.save(GPT(cfg).state_dict(), checkpoint_id=ckpt, no_dist=True)
        backend = "nccl" if args.device == "cuda" else "gloo"
        results = run_ranks(args.world, backend, (cfg, args.strategy, args.device, ckpt, args.batch, args.steps,
                                                  args.lr, args.hardware, args.stacks), args.timeout)
    elapsed = time.perf_counter() - start

    shard = max(r["shard"] for r in results)
    budget = shard + sizes["layer"]
    print(f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} vocab={cfg.vocab_size} "
          f"block={cfg.block_size} bias={cfg.bias}; {args.world} ranks ({backend}), strategy={args.strategy}, "
          f"batch {args.batch}, AdamW")
    print(f"whole model {_mib(sizes['whole'])} MiB = {sizes['whole'] / budget:.2f}x one rank's shard + layer "
          f"({_mib(shard)} + {_mib(sizes['layer'])} MiB, layer = {sizes['layer_name']}; biggest single parameter "
          f"{sizes['biggest_param'][0]} {_mib(sizes['biggest_param'][1])} MiB)\n")
    add_bounds(results, sizes)
    ok = print_table(results, sizes, args.per_rank)
    if args.device == "cpu":
        print_peaks(results, args.per_rank)
    print(f"\nlosses (rank 0): {', '.join(f'{v:.4f}' for v in results[0]['losses'])}; "
          f"{elapsed:.1f} s in all (phase seconds, rank 0: "
          + ", ".join(f"{row['phase']} {row['seconds']:.1f}" for row in results[0]["rows"]) + ")")
    on_meta = all(r["on_meta_after_build"] for r in results)
    print(f"parameters still on the meta device after parallelize, on every rank: {'yes' if on_meta else 'NO'}")
    print("every phase autopar bounds is within its bound" if ok else
          "A PHASE AUTOPAR BOUNDS EXCEEDS ITS BOUND (see 'within')")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
