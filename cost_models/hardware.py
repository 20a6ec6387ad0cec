"""Hardware and topology specs: how fast a device computes, how much it holds,
and how fast each mesh axis talks.

Which mesh axis lives inside a node matters: NVLink is ~10x faster than
InfiniBand, so the same collective costs very differently on the two.

Presets (PRESETS): "h100" (80 GB HBM3 SXM, 700 W), "h100-hbm2e" (the 96 GB HBM2e H100 capped at
500 W of Meta's Grand Teton hosts, torchtitan's published cluster), "h200", "a100", "tpu-v5p", and
"cpu" / "cpu-gloo" for CPU ranks. Each figure's source is the comment above it.

peak_flops is keyed by dtype name; "float8" is the float8 (e4m3/e5m2) tensor-core peak that float8 linears'
matmuls run at (autopar/cost/float8.py). Only presets whose device has float8 tensor cores give it (the
Hopper ones; CPU ranks emulate it at their bf16 rate): a plan asking float8 on one without it is refused, not
priced at another dtype's rate (Hardware.flops_per_second's float32 fallback would do that silently).
"""

import json
import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from .comm import KINDS, collective_time
from .errors import CostModelError


@dataclass(frozen=True)
class Link:
    """One link class, alpha-beta model: time = latency + bytes / bandwidth.

    `kinds` optionally gives some collective kinds ("reduce_scatter", ...) their own Link: what
    autopar.calibrate measures, because a backend may run one kind much slower per byte than
    another on the same wires (gloo's reduce-scatter is an all-reduce of the whole buffer, ~3x an
    ideal ring's time). Kinds not named use this Link's own figures. Stored as a sorted tuple of
    (kind, Link) pairs so Link stays frozen and hashable.
    """
    bandwidth: float  # bytes/s, one direction, per device
    latency: float    # seconds per hop / ring step (alpha)
    kinds: Mapping[str, "Link"] = ()
    # How many of the axis's ranks share a node, which shapes NCCL's tree all-reduce (cost_models.comm): it
    # chains the ranks inside a node and runs a binary tree between nodes. axis_links sets it from the layout;
    # 1 (each rank on a node of its own) for a Link used alone. Where the ranks lie, not what the wires do:
    # left out of ==, so a link given for an axis still equals the hardware's own (describe_links' "given").
    ranks_per_node: int = field(default=1, compare=False)

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency > 0:
            raise CostModelError(f"Link needs positive bandwidth and latency, got "
                                 f"bandwidth={self.bandwidth!r}, latency={self.latency!r}")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                or self.ranks_per_node < 1:
            raise CostModelError(f"Link.ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        pairs = tuple(sorted(dict(self.kinds).items()))
        for kind, link in pairs:
            if not isinstance(link, Link) or link.kinds:
                raise CostModelError(f"Link.kinds[{kind!r}] must be a plain Link (no kinds of its own), got {link!r}")
        object.__setattr__(self, "kinds", pairs)

    def for_kind(self, kind: str) -> "Link":
        """The Link a collective of `kind` runs at: its own where calibrated, else this one."""
        for name, link in self.kinds:   # (a loop, not a dict: asked for every collective the search prices)
            if name == kind:
                return link
        return self


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links between accelerators."""
    name: str
    peak_flops: Mapping[str, float]  # dtype name -> FLOP/s; stored as a sorted tuple of pairs
    memory_bytes: int
    memory_bandwidth: float          # bytes/s
    intra_node_link: Link
    inter_node_link: Link
    devices_per_node: int = 8
    # whether asynchronous collectives run beside compute: a GPU's copy engines and NCCL's own SMs, or
    # CPU ranks with cores to spare; False where a CPU backend's reductions and copies take the cores
    # the ranks compute on (autopar.calibrate decides), so no communication hides
    comm_overlaps_compute: bool = True
    # the share of the matmul peak (at the same dtype) that scaled_dot_product_attention's forward and
    # backward reach, counted as matmul FLOPs (cost/terms.node_compute_time): its softmax, masking and
    # tiling run between the matmuls. 1.0 (the peak) for the presets; autopar.calibrate measures it
    # (about 0.5 on one CPU thread at a GPT block's shape)
    attention_efficiency: float = 1.0
    # The share of peak_flops a training step's matmuls reach, of memory_bandwidth its memory-bound ops
    # (norms, activations, casts: many small kernels) reach run eagerly, and of memory_bandwidth the
    # optimizer step's few large foreach kernels reach: a datasheet peak is not what a step runs at. 1.0
    # for a preset not measured, and for autopar.calibrate's figures (already what this device reached);
    # the GPU presets' from benchmarks/gpu_step.py.
    matmul_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    optimizer_efficiency: float = 1.0
    # Under torch.compile inductor fuses chains of memory-bound ops into one kernel each: the share of
    # their eager time left (Predicted.compiled_step_time). 1.0 (no fusion assumed) unless measured.
    compiled_memory_fraction: float = 1.0

    def __post_init__(self):
        # a dict is not hashable; store a sorted tuple so Hardware stays frozen and hashable
        pairs = tuple(sorted(dict(self.peak_flops).items()))
        if not pairs or any(not v > 0 for _, v in pairs):
            raise CostModelError(f"Hardware {self.name!r}: peak_flops needs positive "
                                 f"entries, e.g. {{'float32': 1e12}}, got {self.peak_flops!r}")
        if not self.memory_bytes > 0 or not self.memory_bandwidth > 0 or not self.devices_per_node > 0 \
                or not all(0 < f for f in (self.attention_efficiency, self.matmul_efficiency,
                                           self.memory_efficiency, self.optimizer_efficiency,
                                           self.compiled_memory_fraction)):
            raise CostModelError(f"Hardware {self.name!r}: memory_bytes, memory_bandwidth, devices_per_node, "
                                 f"attention_efficiency, matmul_efficiency, memory_efficiency, "
                                 f"optimizer_efficiency and compiled_memory_fraction must be positive")
        object.__setattr__(self, "peak_flops", pairs)

    def flops_per_second(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype; unknown dtypes fall back to float32, then to the best."""
        table = dict(self.peak_flops)
        dtype = str(dtype).removeprefix("torch.")  # accept torch.bfloat16 as well as "bfloat16"
        if dtype in table:
            return table[dtype]
        if "float32" in table:
            return table["float32"]
        return max(table.values())


GiB = 2**30
FLOAT8 = "float8"   # peak_flops' key for float8 matmuls (module docstring)
# The 500 W cap's clock factor of "h100-hbm2e" (its comment derives it): 884 TF of the SXM's 989 TF bf16
H100_500W = 884 / 989

# What NCCL's ring collectives (all-gather, reduce-scatter, all-reduce without NVLink SHARP) move per direction
# over an H100's or H200's 18 NVLink 4 links: 20.6 GB/s a link, NCCL's own figure for them (SM90_NVLINK_BW in
# NVIDIA/nccl src/graph/topo.h), 370.8 GB/s in all, against the wire's 18 x 25 = 450. NCCL's maintainers give
# the same, 450 GB/s less ~20% protocol overhead (NVIDIA/nccl-tests#212, NVIDIA/nccl#1442), and reported
# nccl-tests runs on 8 H100s reach 350-362 GB/s bus bandwidth at 1-8 GB (NVIDIA/nccl#1047, #1281). An
# all-reduce on NVLink SHARP (NVLS) reaches ~480 GB/s bus bandwidth on 8 GPUs at large sizes; not modelled:
# all-reduces inside a node are priced at the ring's figure (up to ~30% slower than NVLS runs them). Between
# nodes the links stay at the NIC's line rate (400 Gb/s = 50 GB/s): no NCCL figure or published measurement of
# these clusters' inter-node bus bandwidth is at hand to price less, so inter-node collectives may be fast.
NVLINK_4_NCCL = 18 * 20.6e9

PRESETS = {
    # NVIDIA H100 SXM5 80GB datasheet: dense (no sparsity) tensor-core peaks.
    # float32 uses the TF32 tensor-core figure (494.5 TF), which is what matmuls run
    # at with torch.backends.cuda.matmul.allow_tf32; plain FP32 is only 67 TF. FP8: 1,979 TF dense (the
    # datasheet's 3,958 TF is with sparsity, which no training matmul uses).
    # HBM3 3.35 TB/s; NVLink 4 900 GB/s total = 450 GB/s per direction, of which NCCL's collectives move
    # 370.8 GB/s (NVLINK_4_NCCL below); ConnectX-7 InfiniBand NDR 400 Gb/s = 50 GB/s per GPU.
    "h100": Hardware(
        name="h100",
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12, FLOAT8: 1979e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        intra_node_link=Link(bandwidth=NVLINK_4_NCCL, latency=3e-6),
        inter_node_link=Link(bandwidth=50e9, latency=10e-6),
        # Not measured on an H100 this time: the matmul, attention, optimizer and compiled shares are the
        # H200's (the same GH100 die and clocks; see below). The memory-bound ops' share is fitted to an
        # H100's eager step of the same model, 175.5 ms (torch 2.11, 2026-11, issue 38's table), where the
        # H200's took 151: faster by less than the bandwidths' ratio, as small kernels are not bandwidth alone.
        matmul_efficiency=0.79, attention_efficiency=0.80, memory_efficiency=0.64, optimizer_efficiency=0.73,
        compiled_memory_fraction=0.40,
    ),
    # The H100 of Meta's Grand Teton hosts that torchtitan's published Llama 3 runs used
    # (/work/shared/published/torchtitan-llama3.md, and torchtitan's benchmarks/llama3_h100_202412_torchtitan.md):
    # the 96 GB HBM2e part at 2.4 TB/s, power-capped at 500 W, 8 per host on NVLink 4, 400 Gb/s RDMA per GPU
    # between hosts. Not the 80 GB HBM3 SXM part at 700 W ("h100" above).
    # - Peak FLOP/s: no datasheet gives one at a 500 W cap, so it is derived. The SXM's dense 989 TF (bf16) is
    #   the GH100's 132 SMs at its boost clock at 700 W, where large GEMMs already run at the power limit. A
    #   GEMM's power is mostly dynamic, P ~ f V^2, and along the DVFS curve V ~ f, so P ~ f^3 and the clock a
    #   cap allows is f ~ P^(1/3): (500/700)^(1/3) = 0.894 of it, 884 TF bf16 (442 TF TF32). Checked against a
    #   datasheet of the same die at a lower cap: the H100 NVL (132 SMs, 400 W) lists 835 TF dense bf16, where
    #   the same law from 700 W gives (400/700)^(1/3) x 989 = 821 TF (1.7% under it). float8 runs on the same
    #   SMs at the same clock: the SXM's dense 1,979 TF x 884/989 (H100_500W) = 1,769 TF.
    # - Memory: 6 HBM2e stacks of 16 GiB = 96 GiB (GiB-sized like the SXM's 80 GB), 2.4 TB/s as stated.
    # - NVLink 4 inside a host: 18 links, as the SXM (NVLINK_4_NCCL); between hosts 400 Gb/s RDMA per GPU =
    #   50 GB/s. Latencies as "h100" (same fabric).
    # - Efficiencies, none fitted to a published run: matmul, attention, optimizer and compiled shares are the
    #   H200's measured ones (same die: the share of the clock's peak its kernels reach). The memory-bound ops'
    #   share depends on the bandwidth, as small kernels pay a fixed launch and latency cost beside their
    #   bytes: the H200's measured eager memory-bound time (69 ms for 37.9 ms of bytes at 4.8 TB/s) and the
    #   H100's (0.64 at 3.35 TB/s: 84.9 ms for 54.3) give 32.4 ms fixed + 0.97 x the bytes' time; at 2.4 TB/s
    #   (75.8 ms of bytes) that is 105.6 ms, a share of 0.72.
    "h100-hbm2e": Hardware(
        name="h100-hbm2e",
        peak_flops={"bfloat16": 884e12, "float16": 884e12, "float32": 442e12, FLOAT8: 1979e12 * H100_500W},
        memory_bytes=96 * GiB,
        memory_bandwidth=2.4e12,
        intra_node_link=Link(bandwidth=NVLINK_4_NCCL, latency=3e-6),
        inter_node_link=Link(bandwidth=50e9, latency=10e-6),
        matmul_efficiency=0.79, attention_efficiency=0.80, memory_efficiency=0.72, optimizer_efficiency=0.73,
        compiled_memory_fraction=0.40,
    ),
    # NVIDIA A100 80GB SXM datasheet: BF16/FP16 312 TF, TF32 156 TF (used for float32);
    # HBM2e 2,039 GB/s; NVLink 3 600 GB/s total = 300 GB/s per direction over 12 links, of which NCCL's
    # collectives move 12 x 20.0 = 240 GB/s (NCCL's SM80_NVLINK_BW; see NVLINK_4_NCCL);
    # InfiniBand HDR 200 Gb/s = 25 GB/s per GPU. No "float8": Ampere's tensor cores have no float8 (a float8
    # plan on it is refused: autopar/cost/float8.py).
    "a100": Hardware(
        name="a100",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=2.039e12,
        intra_node_link=Link(bandwidth=12 * 20.0e9, latency=3e-6),
        inter_node_link=Link(bandwidth=25e9, latency=10e-6),
    ),
    # NVIDIA H200 SXM 141GB datasheet: the H100's GH100 die, so the same dense peaks
    # (BF16/FP16 989 TF; TF32 494.5 TF, used for float32; FP8 1,979 TF; the datasheet's 1,979 / 989 /
    # 3,958 TF are with sparsity); HBM3e 141 GB at 4.8 TB/s (141 GB is, like the H100's 80 GB,
    # GiB-sized: nvidia-smi shows ~140 GiB); NVLink 4 as the H100 (NVLINK_4_NCCL);
    # 400 Gb/s InfiniBand NDR per GPU = 50 GB/s. Latencies as for the H100.
    "h200": Hardware(
        name="h200",
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12, FLOAT8: 1979e12},
        memory_bytes=141 * GiB,
        memory_bandwidth=4.8e12,
        intra_node_link=Link(bandwidth=NVLINK_4_NCCL, latency=3e-6),
        inter_node_link=Link(bandwidth=50e9, latency=10e-6),
        # Measured 2026-11-27 on one H200, torch 2.11 (docs/gpu-results.md): one step of
        # benchmarks/gpu_step.py's 0.886B Llama (bf16-mixed, AdamW, 4 x 2048 tokens) against this cost
        # model's terms at the peaks above. Matmul kernels 51.7 ms for 40.8 at the peak; attention 8.4 for
        # 6.7; the optimizer step (timed alone) 21.2 for 15.5; the rest of the eager step (150.4 ms), 69 ms,
        # is the memory-bound ops, 37.9 at the peak. Compiled (inductor), the step took 109.2 ms: 0.40 of
        # the memory-bound ops' time was left.
        matmul_efficiency=0.79, attention_efficiency=0.80, memory_efficiency=0.55, optimizer_efficiency=0.73,
        compiled_memory_fraction=0.40,
    ),
    # Google Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TF bf16 per chip;
    # 95 GiB HBM2e at 2,765 GB/s; ICI 4,800 Gb/s per chip (listed as 1,200 GB/s
    # bidirectional, i.e. 600 GB/s each way over the chip's 6 torus links: 100 GB/s
    # per link and direction); DCN 50 Gb/s per chip between slices (Multislice).
    # float32 matmuls run on the bf16 MXUs in several passes; we take 3 (bf16_3x,
    # torch's "high" precision, the analogue of TF32 on the GPUs): 459 / 3 = 153 TF.
    # Approximate link model: one 3-D torus slice (up to 6,144 chips, 16x16x24) is
    # the "node", so every mesh axis inside it gets ICI and axes beyond it get DCN.
    # An ICI axis is priced as a ring along one torus dimension, sending both ways
    # on its 2 links: 2 x 100 = 200 GB/s. An axis spread over several torus
    # dimensions could use more links (up to 600 GB/s), and axes sharing one
    # dimension would share its links; the two-level model sees neither. The
    # latencies are order-of-magnitude guesses (no published figures). No "float8": v5p's MXUs multiply
    # bf16 and int8.
    "tpu-v5p": Hardware(
        name="tpu-v5p",
        peak_flops={"bfloat16": 459e12, "float32": 153e12},
        memory_bytes=95 * GiB,
        memory_bandwidth=2.765e12,
        intra_node_link=Link(bandwidth=200e9, latency=3e-6),
        inter_node_link=Link(bandwidth=6.25e9, latency=10e-6),
        devices_per_node=6144,
    ),
    # A generic CPU host for gloo test runs (order-of-magnitude figures, not a
    # datasheet): ranks are processes on one machine talking over loopback TCP,
    # so intra and inter "node" links are the same. float8 at the bf16 rate: a CPU has no float8 units, and
    # torch's scaled matmul on CPU upcasts and multiplies (what a float8 plan's CPU test runs do).
    "cpu": Hardware(
        name="cpu",
        peak_flops={"float32": 1e11, "bfloat16": 1e11, FLOAT8: 1e11},
        memory_bytes=16 * GiB,
        memory_bandwidth=20e9,
        intra_node_link=Link(bandwidth=5e9, latency=20e-6),
        inter_node_link=Link(bandwidth=5e9, latency=20e-6),
        devices_per_node=8,
    ),
    # gloo on loopback, as autopar.calibrate measures it on 2 one-thread processes of a 2-core VM
    # (docs/ARCHITECTURE.md section 7b), rounded: ~1 GB/s and ~0.5 ms a call, which a step pays per
    # collective ("cpu" above prices a call at 20 us and under-predicts a gloo step by ~40%). gloo
    # reduce-scatters by all-reducing the whole buffer: ~4x its all-reduce's time per byte in the
    # model's convention (0.38 against 1.5 GB/s measured), so a tensor-parallel plan keeps Megatron's
    # all-reduces instead of trading each for a reduce-scatter and an all-gather (~25% slower a step
    # on gloo). Compute as "cpu". The planner's default for a CPU mesh (autopar.planning.planner._hardware).
    "cpu-gloo": Hardware(
        name="cpu-gloo",   # "cpu..." : saved_tensors.kernel_family reads CPU kernels off the name
        peak_flops={"float32": 1e11, "bfloat16": 1e11, FLOAT8: 1e11},
        memory_bytes=16 * GiB,
        memory_bandwidth=20e9,
        intra_node_link=Link(bandwidth=1e9, latency=5e-4, kinds={"reduce_scatter": Link(0.25e9, 5e-4)}),
        inter_node_link=Link(bandwidth=1e9, latency=5e-4, kinds={"reduce_scatter": Link(0.25e9, 5e-4)}),
        devices_per_node=8,
    ),
}


def get_hardware(spec: "str | Hardware | None", default: str = "h100") -> Hardware:
    """Resolve a preset name (case-insensitive), pass a Hardware through, None -> default."""
    if isinstance(spec, Hardware):
        return spec
    if spec is None:
        spec = default
    if isinstance(spec, str) and spec.strip().lower() in PRESETS:
        return PRESETS[spec.strip().lower()]
    raise CostModelError(f"unknown hardware {spec!r}; known names: {', '.join(sorted(PRESETS))} "
                         f"(or pass a cost_models.Hardware)")


def axis_links(axes: Sequence[tuple[str, int]], hardware: Hardware,
               links: "Mapping[str, Link] | None" = None) -> dict[str, Link]:
    """Link class per mesh axis.

    Default topology: ranks are laid out row-major, so the innermost (last) axis
    holds consecutive ranks. Walking from it outwards, an axis is intra-node while
    the product of the sizes so far (itself included) fits in one node; every axis
    after that crosses nodes. `links` overrides individual axes. Each Link returned carries the axis's
    ranks_per_node in that layout (a given link too: where the ranks lie is the layout's, not the link's).
    """
    names = [name for name, _ in axes]
    links = dict(links or {})
    unknown = [name for name in links if name not in names]
    if unknown:
        raise CostModelError(f"links given for unknown mesh axes {unknown}; mesh axes are {names}")
    result, span = {}, 1
    for name, size in reversed(list(axes)):
        span *= size
        result[name] = hardware.intra_node_link if span <= hardware.devices_per_node else hardware.inter_node_link
    result.update(links)
    per_node = axis_ranks_per_node(axes, hardware.devices_per_node)
    return {name: replace(result[name], ranks_per_node=per_node[name]) for name in names}  # keep mesh order


def axis_ranks_per_node(axes: Sequence[tuple[str, int]], devices_per_node: int) -> dict[str, int]:
    """How many of each mesh axis's ranks share a node, in axis_links' layout (row-major, the last axis
    innermost): an axis's ranks lie as far apart as the sizes inside it multiply to, so a node holds
    devices_per_node // that many of them; all of them where the axis fits in one node, 1 where they are a
    node or more apart."""
    result, span = {}, 1
    for name, size in reversed(list(axes)):
        result[name] = max(1, min(size, devices_per_node // span))
        span *= size
    return {name: result[name] for name, _ in axes}


# Where an axis's ranks lie (axis_reach): all in one node; each a node apart (every ring step crosses nodes);
# or some steps inside a node and some across, which axis_links prices at the slower, inter-node link
INSIDE, ACROSS, SPANS = "inside", "across", "spans"


def axis_reach(axes: Sequence[tuple[str, int]], devices_per_node: int) -> dict[str, str]:
    """INSIDE, ACROSS or SPANS per mesh axis, by axis_links' layout (row-major, the last axis innermost): an
    axis is INSIDE while the product of its size and the sizes after it fits a node; past that, ACROSS where
    the axes after it already fill whole nodes (its neighbours are a node or more apart), else SPANS."""
    result, inner = {}, 1
    for name, size in reversed(list(axes)):
        span = inner * size
        if span <= devices_per_node:
            result[name] = INSIDE
        else:
            result[name] = ACROSS if inner % devices_per_node == 0 else SPANS
        inner = span
    return {name: result[name] for name, _ in axes}


def describe_links(axes: Sequence[tuple[str, int]], hardware: Hardware,
                   links: "Mapping[str, Link]") -> dict[str, dict]:
    """{axis: {"reach", "bandwidth", "latency", "given"}}: where each axis's ranks lie and the link it is priced
    at (`links`: axis_links' result); "given" where that link is not the hardware's own for that reach (a
    calibrated or user-given link). What a Plan records and print(plan) shows."""
    reach = axis_reach(axes, hardware.devices_per_node)
    out = {}
    for name, _ in axes:
        own = hardware.intra_node_link if reach[name] == INSIDE else hardware.inter_node_link
        link = links[name]
        out[name] = {"reach": reach[name], "bandwidth": float(link.bandwidth), "latency": float(link.latency),
                     "given": link != own}
    return out


# --------------------------------------------------------------------------- JSON specs
# A spec is the Hardware's fields plus an optional per-axis-name "links" table (what
# autopar.calibrate measured on each mesh axis) and an optional "measured" record that
# readers ignore. Links are {"bandwidth": bytes/s, "latency": s}.

_REQUIRED = ("name", "peak_flops", "memory_bytes", "memory_bandwidth", "intra_node_link", "inter_node_link")
EFFICIENCIES = ("matmul_efficiency", "memory_efficiency", "optimizer_efficiency", "compiled_memory_fraction")
_OPTIONAL = ("devices_per_node", "comm_overlaps_compute", "attention_efficiency", *EFFICIENCIES, "links", "measured")


def _link_dict(link: Link) -> dict:
    d = {"bandwidth": link.bandwidth, "latency": link.latency}
    if link.kinds:
        d["kinds"] = {kind: _link_dict(k) for kind, k in link.kinds}
    return d


def hardware_to_dict(hardware: Hardware, links: "Mapping[str, Link] | None" = None, measured=None) -> dict:
    """The JSON-ready dict of a Hardware and per-axis links (the inverse of hardware_from_dict)."""
    d = {"name": hardware.name, "peak_flops": dict(hardware.peak_flops), "memory_bytes": int(hardware.memory_bytes),
         "memory_bandwidth": hardware.memory_bandwidth, "intra_node_link": _link_dict(hardware.intra_node_link),
         "inter_node_link": _link_dict(hardware.inter_node_link), "devices_per_node": hardware.devices_per_node,
         "comm_overlaps_compute": hardware.comm_overlaps_compute,
         "attention_efficiency": hardware.attention_efficiency,
         **{f: getattr(hardware, f) for f in EFFICIENCIES},
         "links": {axis: _link_dict(link) for axis, link in (links or {}).items()}}
    if measured is not None:
        d["measured"] = measured
    return d


def _number(value, field: str, source: str, kind=float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"{source}: field {field!r} must be a number, got {value!r}")
    return kind(value)


def _flag(value, field: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise CostModelError(f"{source}: field {field!r} must be true or false, got {value!r}")
    return value


def _link(value, field: str, source: str) -> Link:
    if not isinstance(value, Mapping):
        raise CostModelError(f"{source}: field {field!r} must be {{'bandwidth': bytes/s, 'latency': s}}, "
                             f"got {value!r}")
    for key in ("bandwidth", "latency"):
        if key not in value:
            raise CostModelError(f"{source}: missing field '{field}.{key}'")
    bandwidth = _number(value["bandwidth"], f"{field}.bandwidth", source)
    latency = _number(value["latency"], f"{field}.latency", source)
    unknown = sorted(set(value) - {"bandwidth", "latency", "kinds"})
    if unknown:
        raise CostModelError(f"{source}: unknown field(s) {unknown} in {field!r}; a link has bandwidth, latency "
                             f"and optionally kinds")
    kinds = value.get("kinds") or {}
    if not isinstance(kinds, Mapping):
        raise CostModelError(f"{source}: field '{field}.kinds' must map collective kinds to links, got {kinds!r}")
    if ".kinds." in field and kinds:
        raise CostModelError(f"{source}: {field} is a collective's own link; it cannot have kinds of its own")
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise CostModelError(f"{source}: unknown collective kind(s) {bad} in '{field}.kinds'; known: {', '.join(KINDS)}")
    own = {kind: _link(v, f"{field}.kinds.{kind}", source) for kind, v in kinds.items()}
    try:
        return Link(bandwidth, latency, own)
    except CostModelError as e:
        raise CostModelError(f"{source}: {field}: {e}") from None


def hardware_from_dict(d, source: str = "hardware spec") -> "tuple[Hardware, dict[str, Link]]":
    """(Hardware, {axis name: Link}) from a spec dict; CostModelError naming `source` and the bad field."""
    if not isinstance(d, Mapping):
        raise CostModelError(f"{source}: a hardware spec is a JSON object, got {type(d).__name__}")
    missing = [f for f in _REQUIRED if f not in d]
    if missing:
        raise CostModelError(f"{source}: missing field {missing[0]!r} (a hardware spec needs "
                             f"{', '.join(_REQUIRED)}; optional: {', '.join(_OPTIONAL)})")
    unknown = sorted(set(d) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise CostModelError(f"{source}: unknown field(s) {unknown}; known: {', '.join(_REQUIRED + _OPTIONAL)}")
    flops = d["peak_flops"]
    if not isinstance(flops, Mapping):
        raise CostModelError(f"{source}: field 'peak_flops' must map dtype names to FLOP/s, got {flops!r}")
    links = d.get("links") or {}
    if not isinstance(links, Mapping):
        raise CostModelError(f"{source}: field 'links' must map mesh axis names to links, got {links!r}")
    fields = dict(
        name=str(d["name"]), peak_flops={str(k): _number(v, f"peak_flops.{k}", source) for k, v in flops.items()},
        memory_bytes=_number(d["memory_bytes"], "memory_bytes", source, int),
        memory_bandwidth=_number(d["memory_bandwidth"], "memory_bandwidth", source),
        intra_node_link=_link(d["intra_node_link"], "intra_node_link", source),
        inter_node_link=_link(d["inter_node_link"], "inter_node_link", source),
        devices_per_node=_number(d.get("devices_per_node", 8), "devices_per_node", source, int),
        comm_overlaps_compute=_flag(d.get("comm_overlaps_compute", True), "comm_overlaps_compute", source),
        attention_efficiency=_number(d.get("attention_efficiency", 1.0), "attention_efficiency", source),
        **{f: _number(d.get(f, 1.0), f, source) for f in EFFICIENCIES})
    try:
        hardware = Hardware(**fields)
    except CostModelError as e:
        raise CostModelError(f"{source}: {e}") from None
    return hardware, {str(axis): _link(v, f"links.{axis}", source) for axis, v in links.items()}


def save_hardware(path, hardware: Hardware, links: "Mapping[str, Link] | None" = None, measured=None) -> None:
    """Write a JSON spec that load_hardware (and autopar.plan(hardware=path)) reads back."""
    with open(path, "w") as f:
        json.dump(hardware_to_dict(hardware, links, measured), f, indent=2)
        f.write("\n")


def load_hardware(path) -> "tuple[Hardware, dict[str, Link]]":
    """(Hardware, {axis name: Link}) from a JSON spec file; CostModelError naming the file on any problem."""
    source = f"hardware spec {os.fspath(path)!r}"
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise CostModelError(f"{source}: cannot read it ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise CostModelError(f"{source}: not valid JSON ({e})") from e
    return hardware_from_dict(d, source)


@dataclass(frozen=True)
class Calibration:
    """What autopar.calibrate measured: the Hardware, a fitted Link per mesh axis name, and the measured
    points per axis and collective, ((whole-tensor bytes, seconds), ...), the fits came from. Here, with
    the specs, so the planner takes one as `hardware=` (resolve_hardware) without reaching up to autopar."""
    hardware: Hardware
    links: dict
    axis_sizes: dict
    times: dict

    def relative_errors(self) -> dict:
        """{axis: {kind: ((bytes, predicted / measured - 1), ...)}}: how well each fit reproduces its points."""
        return {axis: {kind: tuple((b, float(collective_time(kind, b, self.axis_sizes[axis], self.links[axis]))
                                    / t - 1) for b, t in points) for kind, points in kinds.items()}
                for axis, kinds in self.times.items()}

    def save(self, path) -> None:
        """Write the JSON spec (the measured points go along under "measured", which readers ignore)."""
        measured = {a: {"size": self.axis_sizes[a], **{k: [list(p) for p in pts] for k, pts in kinds.items()}}
                    for a, kinds in self.times.items()}
        save_hardware(path, self.hardware, self.links, measured=measured)


def resolve_hardware(spec, default: str = "h100") -> "tuple[Hardware, dict[str, Link]]":
    """(Hardware, per-axis links) from what a user passes as `hardware=`: a preset name, a Hardware,
    a Calibration, a spec dict, or a path to a JSON spec (a name that is no preset and ends in .json or
    names a file). Only a Calibration or a spec brings per-axis links; the others bring none."""
    if isinstance(spec, Calibration):
        return spec.hardware, dict(spec.links)
    if isinstance(spec, Mapping):
        return hardware_from_dict(spec)
    is_preset = isinstance(spec, str) and spec.strip().lower() in PRESETS
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and not is_preset
                                         and (spec.endswith(".json") or os.path.isfile(spec))):
        return load_hardware(spec)
    if spec is None or isinstance(spec, Hardware) or is_preset:
        return get_hardware(spec, default), {}
    raise CostModelError(f"unknown hardware {spec!r}; give a preset name ({', '.join(sorted(PRESETS))}), a "
                         f"cost_models.Hardware, an autopar.Calibration, a spec dict, or the path of a JSON spec (autopar.calibrate "
                         f"writes one)")
