"""autopar.calibrate: measure the user's own devices and mesh axes, so plans price them as they are.

Run on every rank after init_device_mesh. Per named mesh axis it times all-reduce, all-gather,
reduce-scatter and all-to-all over a few message sizes (every slice of the axis at once, as a
training step runs them), takes each point's mean over repeats after a warm-up and the
maximum over ranks (one MAX all-reduce, so every rank returns the same figures), and fits one
`Link(bandwidth, latency)` per axis and collective kind by least squares to the cost model's own
formula (cost_models.comm.collective_time: `latency * (n-1) + bytes_moved(kind, B, n) / bandwidth` for a
ring, and for an all-reduce the faster of that and NCCL's tree), so the planner's predictions reproduce the
measured times. It also times a square matmul (FLOP/s per
dtype) and a large copy (memory bandwidth) on this rank's device. The result is a
cost_models.Hardware plus the per-axis links; `path=` writes them as a JSON spec that
`autopar.plan(..., hardware=path)` reads, applying each link to the mesh axis of the same name.
"""
from __future__ import annotations

import collections
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

import cost_models as cm
from cost_models.hardware import Calibration

from ._compat import scaled_mm
from .errors import MeshError

KINDS = (cm.ALL_REDUCE, cm.ALL_GATHER, cm.REDUCE_SCATTER, cm.ALL_TO_ALL)
KiB, MiB = 2**10, 2**20
# 4 KiB .. 16 MiB in powers of 4: from latency-bound to bandwidth-bound on every link we know
# (a 16 MiB ring step takes ~1 ms even on NVLink, far above its ~3 us latency), in 7 points.
DEFAULT_SIZES = tuple(4 * KiB * 4**k for k in range(7))
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB)
# Ten repeats make a compute median robust to one or two hiccups (a page fault, a scheduler tick),
# and a collective's mean count them about as often as a step meets them,
# at a few seconds for the whole sweep on loopback gloo; quick mode keeps three.
DEFAULT_REPEATS, QUICK_REPEATS = 10, 3
# Two untimed calls before each point: the first collective of a shape sets up buffers. And
# before an axis's first point, WARMUP_SECONDS of small all-reduces: a fresh group's first ones
# run up to 10x slower (connections, lazy allocation, CPU clocks ramping up; seen on gloo).
WARMUP, WARMUP_SECONDS = 2, 0.25
# A fitted latency below 100 ns is noise (no network stack steps that fast; NVLink is ~3 us):
# clamp there, since cost_models.Link needs a positive latency. Likewise bandwidth at 1 PB/s.
MIN_LATENCY, MAX_BANDWIDTH = 1e-7, 1e15
# fit_link's refits, each giving every all-reduce point the algorithm (ring or tree) the last fit prices
# fastest: a handful settle it (most sweeps cross between the two once)
MAX_REFITS = 8
# (square matmul side, (bytes of one elementwise input, how many)) per device type. A side-n fp32
# matmul does n/6 FLOP per byte: at 1024 far past a CPU's ridge point (~10) and ~40 ms on one core; a
# GPU needs 8192 (~1 ms at its peak) to hide launch overhead. The elementwise ops (_elementwise_time)
# run over inputs of a step's activation size, 128 MiB of them in all on a CPU (past any last-level
# cache, so each is cold when read, as in a step) and 1 GiB on a GPU (~1 ms of HBM traffic at 3 TB/s
# a round). Quick mode: seconds don't matter there.
COMPUTE_SIZES = {"cpu": (1024, (2 * MiB, 64)), "quick": (256, (256 * KiB, 4))}
DEFAULT_COMPUTE_SIZES = (8192, (64 * MiB, 16))
# the ops of an elementwise round, each reading its input and writing a new output
ELEMENTWISE_OPS = 3
# (batch, heads, sequence, head dim) of the timed causal attention, per device type: a GPT block's on a
# CPU rank, a Llama-8B block's on a GPU (run in bf16 there, flash attention's dtype)
ATTENTION_SHAPES = {"cpu": (2, 8, 256, 64), "quick": (1, 2, 64, 32)}
DEFAULT_ATTENTION_SHAPE = (1, 32, 4096, 128)
# The compute before each timed collective (_compute_burst): 4 square matmuls, ~1.3 ms on one CPU
# core at side 256, ~1 ms on an H100 at 4096.
BURST_MATMULS, BURST_SIDE, DEFAULT_BURST_SIDE = 4, {"cpu": 256}, 4096

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def calibrate(mesh, path=None, *, sizes=None, repeats=None, quick: bool = False) -> Calibration:
    """Measure collectives per mesh axis and this device's compute; call on every rank of the job.

    `sizes`: whole-tensor bytes per collective (DEFAULT_SIZES; QUICK_SIZES when `quick`);
    `repeats`: timed calls per point (10; 3 when `quick`, which also shrinks the matmul and copy).
    `path`: rank 0 writes the JSON spec there (every rank returns after it is written).
    The Hardware is named "<device type>-calibrated-<backend>": the device type first, because the
    planner picks CPU or CUDA kernels' saved tensors by a name starting with "cpu".
    """
    device_type, axes = _check(mesh)
    sizes = tuple(sizes or (QUICK_SIZES if quick else DEFAULT_SIZES))
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    points = [(name, group, n, kind, _whole_bytes(b, n)) for name, group, n in axes for kind in KINDS for b in sizes]
    side, (elementwise_bytes, num_inputs) = COMPUTE_SIZES.get("quick" if quick else device_type,
                                                              DEFAULT_COMPUTE_SIZES)
    dtypes = ("float32", "bfloat16") if device_type == "cpu" else ("float32", "bfloat16", "float16")
    for _, group, _ in axes:
        _warm_up(group, device_type)
    local = [_time_collective(kind, b, group, n, device_type, repeats) for _, group, n, kind, b in points]
    local += [_matmul_time(getattr(torch, d), side, device_type, repeats) for d in dtypes]
    local.append(_float8_matmul_time(side, device_type, repeats))
    attention_dtype = "float32" if device_type == "cpu" else "bfloat16"
    attention_shape = ATTENTION_SHAPES.get("quick" if quick else device_type, DEFAULT_ATTENTION_SHAPE)
    local.append(_attention_time(attention_shape, getattr(torch, attention_dtype), device_type, repeats))
    local.append(_elementwise_time(elementwise_bytes, num_inputs, device_type, repeats))
    worst = _world_max(local, device_type)
    times, axis_sizes = {}, {name: n for name, _, n in axes}
    for (name, _, _, kind, b), t in zip(points, worst):
        times.setdefault(name, {}).setdefault(kind, []).append((b, t))
    memory_bytes, per_node = _memory_and_ranks_per_node(device_type)
    shape = cm.axis_ranks_per_node([(name, n) for name, _, n in axes], per_node)
    links = {a: axis_link(kinds, axis_sizes[a], shape[a]) for a, kinds in times.items()}
    matmul, attention, elementwise = worst[len(points):-2], worst[-2], worst[-1]
    flops = {d: 2 * side**3 / t for d, t in zip(dtypes + (cm.FLOAT8,), matmul) if t < float("inf")}
    # counted as the cost model counts them (terms.node_compute_time): 3 x (QK^T + PV) FLOPs, causal or not
    b, h, s, d = attention_shape
    attention_rate = cm.TRAIN_FLOPS_FACTOR * 4 * b * h * s * s * d / attention
    efficiency = attention_rate / flops.get(attention_dtype, flops["float32"]) if attention < float("inf") else 1.0
    intra, inter = _node_links(axes, links, per_node, device_type)
    streamed = 2 * ELEMENTWISE_OPS * elementwise_bytes * num_inputs   # bytes read and written by a round
    hw = cm.Hardware(name=f"{device_type}-calibrated-{_backend(device_type)}", peak_flops=flops,
                     memory_bytes=memory_bytes, memory_bandwidth=streamed / elementwise,
                     intra_node_link=intra, inter_node_link=inter, devices_per_node=per_node,
                     comm_overlaps_compute=comm_can_overlap(device_type, per_node, torch.get_num_threads(),
                                                            _cores()),
                     attention_efficiency=efficiency)
    result = Calibration(hw, links, axis_sizes, times)
    if path is not None and dist.get_rank() == 0:
        result.save(path)
    _world_max([0.0], device_type)   # a barrier: no rank returns before the file exists
    return result


def axis_link(times: dict, n: int, per_node: int = 1) -> cm.Link:
    """One axis's Link: fitted to all its points, with each collective kind's own fit under `kinds`
    (a backend may run one kind ~3x slower per byte than another: gloo's reduce-scatter); the shared
    figures price the kinds calibration did not time (send/recv). `per_node`: how many of the axis's ranks
    share a node (the Link's ranks_per_node, which shapes an all-reduce's tree)."""
    own = {kind: fit_link([(kind, b, t) for b, t in pts], n, per_node) for kind, pts in times.items()
           if len(pts) >= 2}
    shared = fit_link([(k, b, t) for k, pts in times.items() for b, t in pts], n, per_node)
    return cm.Link(shared.bandwidth, shared.latency, own, ranks_per_node=per_node)


def fit_link(points, n: int, per_node: int = 1) -> cm.Link:
    """The Link whose cost-model time best reproduces measured (kind, whole bytes, seconds) points on an
    axis of n devices, `per_node` of them in a node: least squares on relative errors (each row divided by
    its time), because the times span three orders of magnitude and plain least squares would fit the
    largest messages only, leaving the latency to chance.

    The model prices an all-reduce by the faster of its ring and tree (cm.algorithm_terms), each linear in
    latency and 1/bandwidth: fit with every point on the ring, give each point the algorithm the fit makes
    fastest, refit, until no point changes (or MAX_REFITS), keeping the fit of least error under the model."""
    terms = [cm.algorithm_terms(kind, b, n, per_node) for kind, b, _ in points]
    pick, best = [0] * len(points), None
    for _ in range(MAX_REFITS):
        link = _fit_rows([(*terms[i][j], t) for i, (j, (_, _, t)) in enumerate(zip(pick, points))], per_node)
        priced = [[link.latency * steps + float(moved) / link.bandwidth for steps, moved in ts] for ts in terms]
        error = sum((min(p) / t - 1) ** 2 for p, (_, _, t) in zip(priced, points))
        if best is None or error < best[0]:
            best = (error, link)
        fastest = [p.index(min(p)) for p in priced]
        if fastest == pick:
            break
        pick = fastest
    return best[1]


def _fit_rows(points, per_node: int) -> cm.Link:
    """Least squares of (latency steps, bytes over bandwidth, seconds) points to latency and bandwidth, on
    relative errors. Latency is clamped to MIN_LATENCY (then bandwidth refit alone)."""
    rows = [(steps / t, float(moved) / t) for steps, moved, t in points]
    saa, sab, sbb = (sum(a * a for a, _ in rows), sum(a * b for a, b in rows), sum(b * b for _, b in rows))
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, beta = ((sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det) if det > 1e-12 * saa * sbb else (0, 0)
    if alpha < MIN_LATENCY:
        alpha = MIN_LATENCY
        beta = sum(b * (1 - alpha * a) for a, b in rows) / sbb
    if beta < 1 / MAX_BANDWIDTH:
        beta = 1 / MAX_BANDWIDTH
        alpha = max(MIN_LATENCY, sum(a * (1 - beta * b) for a, b in rows) / saa)
    return cm.Link(bandwidth=1 / beta, latency=alpha, ranks_per_node=per_node)


def _check(mesh):
    """(device type, [(axis name, process group, size)] for axes of 2+ devices), or MeshError."""
    from torch.distributed.device_mesh import DeviceMesh
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("autopar.calibrate: torch.distributed is not initialized; run it on every rank under "
                        "torchrun after dist.init_process_group and init_device_mesh")
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"autopar.calibrate needs a torch DeviceMesh, got {type(mesh).__name__}; build one with "
                        "init_device_mesh('cpu', (2,), mesh_dim_names=('dp',)) (use 'cuda' on GPUs)")
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    keys = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    axes = [(name, mesh.get_group(key), int(size)) for name, key, size in zip(names, keys, mesh.shape) if size > 1]
    return mesh.device_type, axes


def _whole_bytes(nbytes: int, n: int) -> int:
    """nbytes rounded up to float32 elements that split into n x n equal blocks (all-to-all's)."""
    block = 4 * n * n
    return -(-int(nbytes) // block) * block


def _time_collective(kind: str, whole_bytes: int, group, n: int, device_type: str, repeats: int) -> float:
    """Mean seconds of one collective on `whole_bytes` (cost_models' convention: the all-gather output,
    the reduce-scatter input, the all-reduce tensor; for all-to-all, n times each rank's buffer).

    The mean, not the median: a step pays the sum of its collectives, whose expectation is their
    number times the mean, and the times are skewed to the right (a rank late now and then, which
    the other waits for). On 2 gloo ranks here the median priced a tensor-parallel step's exposed
    communication 25-30 ms against ~75 ms measured, the mean 40-47 ms."""
    whole = torch.ones(whole_bytes // 4, device=device_type)
    piece = torch.ones(whole_bytes // 4 // n, device=device_type)
    out = torch.empty_like(piece)
    run = {cm.ALL_REDUCE: lambda: dist.all_reduce(whole, group=group),
           cm.ALL_GATHER: lambda: _all_gather(whole, piece, group=group),
           cm.REDUCE_SCATTER: lambda: _reduce_scatter(out, whole, group=group),
           cm.ALL_TO_ALL: lambda: dist.all_to_all_single(out, piece, group=group)}[kind]
    return _typical_time(run, repeats, device_type, before=_compute_burst(device_type), statistic=statistics.mean)


def _warm_up(group, device_type: str) -> None:
    """Small all-reduces for WARMUP_SECONDS, rank 0's clock deciding when to stop (so all ranks stop together)."""
    x, stop, t0 = torch.ones(1024, device=device_type), torch.zeros(1, device=device_type), time.perf_counter()
    while not stop.item():
        dist.all_reduce(x, group=group)
        stop.fill_(float(time.perf_counter() - t0 > WARMUP_SECONDS and dist.get_rank(group) == 0))
        dist.all_reduce(stop, group=group)


def _compute_burst(device_type: str):
    """A few milliseconds of matmuls, run untimed before each timed collective.

    A step issues each collective after compute, not back to back, and that is slower: on 2 gloo
    processes on 2 cores a 1 MiB all-reduce took 0.7 ms back to back and 4.8 ms after a 1.3 ms
    matmul (caches and the backend's threads gone cold, the ranks no longer in step), which is
    what a tensor-parallel step measured per call. Timed back to back, the fitted link predicted
    a third of that step's communication."""
    side = BURST_SIDE.get(device_type, DEFAULT_BURST_SIDE)
    a = torch.randn(side, side, device=device_type)
    return lambda: [torch.mm(a, a) for _ in range(BURST_MATMULS)]


def _typical_time(fn, repeats: int, device_type: str, before=None, statistic=statistics.median) -> float:
    """Seconds of fn(), `statistic` over `repeats` timed calls after WARMUP untimed ones (each after
    `before()`, untimed, if given). The median by default: for a rate (a matmul's FLOP/s, a copy's
    bytes/s) it is the typical call, unmoved by the odd scheduler hiccup and not the luckiest call either."""
    for _ in range(WARMUP):
        fn()
    _sync(device_type)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
            _sync(device_type)
        t0 = time.perf_counter()
        fn()
        _sync(device_type)
        times.append(time.perf_counter() - t0)
    return statistic(times)


def _sync(device_type: str) -> None:
    """Wait for the device's queued work (CUDA runs kernels and NCCL collectives asynchronously)."""
    if device_type == "cuda":
        torch.cuda.synchronize()


def _matmul_time(dtype, side: int, device_type: str, repeats: int) -> float:
    """Median seconds of a side^3 matmul in `dtype`; inf if this device cannot run it (then dropped)."""
    try:
        a = torch.randn(side, side, device=device_type).to(dtype)
        return _typical_time(lambda: torch.mm(a, a), repeats, device_type)
    except (RuntimeError, TypeError):
        return float("inf")


def _float8_matmul_time(side: int, device_type: str, repeats: int) -> float:
    """Median seconds of a side^3 float8 matmul as a float8 linear runs it (e4m3 operands, the second column by
    column, a bf16 product); inf where this device cannot run one (a GPU without float8 tensor cores), so a
    calibrated hardware prices float8 at what this device does (a CPU emulates it, slowly) or refuses it."""
    try:
        a = torch.randn(side, side, device=device_type).to(torch.float8_e4m3fn)
        b = torch.randn(side, side, device=device_type).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device_type)
        return _typical_time(lambda: scaled_mm(a, b, one, one, torch.bfloat16, False), repeats, device_type)
    except (RuntimeError, TypeError, AttributeError):
        return float("inf")


def _attention_time(shape: tuple, dtype, device_type: str, repeats: int) -> float:
    """Median seconds of a causal scaled_dot_product_attention's forward and backward on `shape`
    (batch, heads, sequence, head dim); inf if this device cannot run it in `dtype` (the efficiency
    then stays 1.0). Its rate against the matmul's is Hardware.attention_efficiency: on one CPU thread
    here ~0.5 at a GPT block's shape, which priced at the matmul rate left ~5 ms of a 4-layer GPT's
    step unpriced."""
    try:
        q, k, v = (torch.randn(shape, device=device_type, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.ones(shape, device=device_type, dtype=dtype)

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        return _typical_time(step, repeats, device_type)
    except (RuntimeError, TypeError):
        return float("inf")


def _elementwise_time(nbytes: int, num_inputs: int, device_type: str, repeats: int) -> float:
    """Median seconds of one round of elementwise ops as a training step runs them: a GELU, a layer norm
    and a scale over each of `num_inputs` fp32 inputs of `nbytes`, each op reading its input and writing
    a new output, all outputs alive until the round ends (2 * ELEMENTWISE_OPS * nbytes * num_inputs bytes
    through memory). The memory leg of the roofline prices a step's norms, activations, residual adds and
    the optimizer's update, which run over cold activations into fresh memory, not one long copy."""
    width = 256
    inputs = [torch.randn(nbytes // 4 // width, width, device=device_type) for _ in range(num_inputs)]
    weight = torch.ones(width, device=device_type)

    def one_round():
        return [out for x in inputs for out in (torch.nn.functional.gelu(x),
                                                 torch.nn.functional.layer_norm(x, (width,), weight), x * 0.5)]
    return _typical_time(one_round, repeats, device_type)


def _world_max(values: list, device_type: str) -> list:
    """The maximum over all ranks of each value (times: the slowest rank is what a step waits for)."""
    t = torch.tensor(values, dtype=torch.float64, device=device_type)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def comm_can_overlap(device_type: str, ranks_per_node: int, threads_per_rank: int, cores: int) -> bool:
    """Whether asynchronous collectives can run beside compute. A GPU's can (NCCL on its own stream). A CPU
    backend reduces and copies on CPU threads: they only run beside compute when the ranks' compute threads
    leave a core free on the host; otherwise they take the cores backward runs on, and nothing hides
    (measured on 2 gloo ranks of 1 thread on 2 cores: an FSDP step's reduce-scatters, priced as hidden,
    added their time to the step)."""
    return device_type != "cpu" or ranks_per_node * threads_per_rank < cores


def _cores() -> int:
    """Cores this process may run on (its affinity, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def _memory_and_ranks_per_node(device_type: str) -> tuple[int, int]:
    """(bytes each rank may use, the most ranks on one host): a GPU's own memory, or a host's RAM
    shared by the ranks on it; the smallest over ranks, so every rank agrees."""
    if device_type == "cuda":
        mine = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        mine = _host_memory()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), mine))
    per_host = collections.Counter(host for host, _ in gathered)
    memory = min(m if device_type == "cuda" else m // per_host[h] for h, m in gathered)
    return int(memory), max(per_host.values())


def _host_memory() -> int:
    """Total RAM of this host (psutil may not be installed): /proc/meminfo, else sysconf."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _node_links(axes, links: dict, per_node: int, device_type: str):
    """The Hardware's intra- and inter-node links, for mesh axes the spec does not name: the innermost
    measured axis within a node (cost_models.axis_links' rule) and the outermost one beyond it; one
    stands in for the other where only one kind was measured, and a preset's where none was."""
    inside, beyond, span = [], [], 1
    for name, _, n in reversed(axes):
        span *= n
        (inside if span <= per_node else beyond).append(links[name])
    preset = cm.get_hardware(None, default="cpu-gloo" if device_type == "cpu" else "h100")
    intra = inside[0] if inside else beyond[-1] if beyond else preset.intra_node_link
    inter = beyond[-1] if beyond else inside[-1] if inside else preset.inter_node_link
    return intra, inter


def _backend(device_type: str) -> str:
    """The backend, for the Hardware's name: "gloo", "nccl", "threaded" (of "cpu:gloo,cuda:nccl", this device's)."""
    backend = str(dist.get_backend())
    return dict(p.split(":") for p in backend.split(",") if ":" in p).get(device_type, backend)
