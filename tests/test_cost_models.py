"""cost_models: formulas on ints and on sympy symbols, topology defaults, byte parsing."""

import math
from dataclasses import replace

import pytest
import sympy
from hypothesis import given, strategies as st

import cost_models as cm
from cost_models import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, SEND_RECV,
                         CostModelError, Hardware, Link)

H100 = cm.PRESETS["h100"]
RING_KINDS = [ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL]


# --- comm -------------------------------------------------------------------

@pytest.mark.parametrize("kind,factor", [(ALL_GATHER, 7 / 8), (REDUCE_SCATTER, 7 / 8),
                                         (ALL_REDUCE, 14 / 8), (ALL_TO_ALL, 7 / 64),
                                         (SEND_RECV, 1.0)])
def test_bytes_moved_values(kind, factor):
    assert cm.bytes_moved(kind, 1024, 8) == pytest.approx(1024 * factor)


@pytest.mark.parametrize("kind", [ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, SEND_RECV])
def test_single_device_is_free(kind):
    assert cm.bytes_moved(kind, 10**9, 1) == 0
    assert cm.collective_time(kind, 10**9, 1, H100.inter_node_link) == 0


def test_collective_time_alpha_beta():
    link = Link(bandwidth=100.0, latency=0.5)
    assert cm.collective_time(ALL_GATHER, 800, 4, link) == pytest.approx(0.5 * 3 + 600 / 100)
    assert cm.collective_time(ALL_REDUCE, 800, 4, link) == pytest.approx(0.5 * 3 + 1200 / 100)
    assert cm.collective_time(SEND_RECV, 800, 4, link) == pytest.approx(0.5 + 800 / 100)


def test_intra_node_faster_than_inter_node():
    intra = cm.collective_time(ALL_REDUCE, 2**30, 8, H100.intra_node_link)
    inter = cm.collective_time(ALL_REDUCE, 2**30, 8, H100.inter_node_link)
    assert inter > 5 * intra


def test_unknown_kind():
    with pytest.raises(CostModelError, match="broadcast"):
        cm.bytes_moved("broadcast", 10, 2)
    with pytest.raises(CostModelError, match="all_gather"):  # message lists known kinds
        cm.collective_time("broadcast", 10, 2, H100.intra_node_link)


@given(kind=st.sampled_from(RING_KINDS + [SEND_RECV]), n=st.integers(1, 1024), per_node=st.integers(1, 16),
       batch=st.integers(1, 4096), seq=st.integers(1, 8192), width=st.integers(1, 16384))
def test_comm_symbolic_matches_numeric(kind, n, per_node, batch, seq, width):
    # at the example's sizes (the hints) the symbolic time is the numeric one: an all-reduce takes the
    # algorithm, ring or tree, that is faster there (widths from 1 byte to GiBs cross between the two)
    b, s = sympy.symbols("batch seq", positive=True, integer=True)
    link = replace(H100.inter_node_link, ranks_per_node=per_node)
    values = {b: batch, s: seq}
    for fn in (lambda B: cm.bytes_moved(kind, B, n), lambda B: cm.collective_time(kind, B, n, link, values)):
        symbolic = sympy.sympify(fn(2 * b * s * width))
        assert symbolic.free_symbols <= {b, s}
        numeric = fn(2 * batch * seq * width)
        assert float(symbolic.subs(values)) == pytest.approx(numeric, rel=1e-12, abs=1e-30)


def test_tiny_all_reduce_on_a_wide_axis_takes_the_tree():
    # a float8 amax (4 bytes) on torchtitan's 128-GPU data-parallel axis, 16 nodes of 8: NCCL's tree chains
    # the 8 ranks of a node and runs a binary tree over the 16 nodes, 7 + log2(16) = 11 steps, not the ring's 127
    link = cm.axis_links([("dp", 128)], cm.PRESETS["h100-hbm2e"])["dp"]
    assert link.ranks_per_node == 8
    ring = link.latency * 127 + 2 * 127 / 128 * 4 / link.bandwidth
    assert cm.collective_time(ALL_REDUCE, 4, 128, link) == link.latency * 11 + 2 * 4 / link.bandwidth
    assert cm.collective_time(ALL_REDUCE, 4, 128, link) < ring / 10
    # a data-parallel axis outside 8-way tensor parallelism has each rank on a node of its own: log2(16) = 4
    dp = cm.axis_links([("dp", 16), ("tp", 8)], H100)["dp"]
    assert dp.ranks_per_node == 1
    assert cm.collective_time(ALL_REDUCE, 4, 16, dp) == dp.latency * 4 + 2 * 4 / dp.bandwidth
    # other kinds keep the ring
    assert cm.collective_time(ALL_GATHER, 4, 128, link) == link.latency * 127 + 127 * 4 / 128 / link.bandwidth


def test_large_all_reduce_keeps_the_ring_price():
    link = Link(bandwidth=100.0, latency=0.5)
    # n=4: the ring 3 steps and 1.5 B, the tree 2 steps and 2 B; they cross at B = 2 x latency x bandwidth = 100
    assert cm.collective_time(ALL_REDUCE, 40, 4, link) == 0.5 * 2 + 80 / 100
    assert cm.collective_time(ALL_REDUCE, 800, 4, link) == 0.5 * 3 + 2 * 3 * 800 / 4 / 100
    assert cm.algorithm_terms(ALL_REDUCE, 800, 4) == ((3, 1200), (2, 1600))
    # 1 GiB on 128 ranks: the ring, to the last bit, as before the tree was priced
    wide = cm.axis_links([("dp", 128)], cm.PRESETS["h100-hbm2e"])["dp"]
    big = 10 * 2**30
    assert cm.collective_time(ALL_REDUCE, big, 128, wide) == wide.latency * 127 + 2 * 127 * big / 128 / wide.bandwidth


@pytest.mark.parametrize("n", [2, 3, 8])
def test_all_reduce_inside_a_node_is_the_ring(n):
    # NCCL's tree is a chain inside a node: as many steps as the ring and more bytes, so it never wins there
    link = cm.axis_links([("tp", n)], H100)["tp"]
    assert link.ranks_per_node == n and cm.algorithm_terms(ALL_REDUCE, 4, n, n) == ((n - 1, 2 * (n - 1) * 4 / n),)
    assert cm.collective_time(ALL_REDUCE, 4, n, link) == link.latency * (n - 1) + 2 * (n - 1) * 4 / n / link.bandwidth


def test_symbolic_all_reduce_needs_the_example_sizes():
    b = sympy.Symbol("batch", positive=True)
    with pytest.raises(CostModelError, match="hints"):
        cm.collective_time(ALL_REDUCE, 4 * b, 128, Link(1e9, 1e-5))
    # small at the example: the tree's expression, linear in the batch; large: the ring's
    for example, steps, per_byte in ((1, 7, 2), (10**12, 127, 2 * 127 / 128)):
        t = sympy.expand(cm.collective_time(ALL_REDUCE, 4 * b, 128, Link(1e9, 1e-5), {b: example}))
        assert float(t.coeff(b, 0)) == pytest.approx(1e-5 * steps, rel=1e-12)
        assert float(t.coeff(b, 1)) == pytest.approx(4 * per_byte / 1e9, rel=1e-12)


def test_comm_symbolic_is_exact():
    b = sympy.Symbol("batch", positive=True)
    assert cm.bytes_moved(ALL_GATHER, 8 * b, 4) == 6 * b
    assert cm.bytes_moved(ALL_TO_ALL, 16 * b, 4) == 3 * b


@given(kind=st.sampled_from(RING_KINDS), n=st.integers(2, 512), B=st.integers(1, 2**40))
def test_ring_bytes_bounds(kind, n, B):
    moved = cm.bytes_moved(kind, B, n)
    assert 0 < moved < (2 * B if kind == ALL_REDUCE else B)
    assert cm.bytes_moved(ALL_REDUCE, B, n) == pytest.approx(2 * cm.bytes_moved(ALL_GATHER, B, n))


# --- compute ----------------------------------------------------------------

def test_compute_terms():
    assert cm.matmul_flops(2, 3, 4) == 48
    assert cm.TRAIN_FLOPS_FACTOR == 3
    assert cm.compute_time(989e12, "bfloat16", H100) == pytest.approx(1.0)
    assert cm.compute_time(494.5e12, "float32", H100) == pytest.approx(1.0)
    # a step's memory-bound ops and its optimizer reach their shares of the bandwidth (hardware.py)
    assert cm.memory_time(3.35e12 * H100.memory_efficiency, H100) == pytest.approx(1.0)
    assert cm.optimizer_time(3.35e12 * H100.optimizer_efficiency, H100) == pytest.approx(1.0)
    assert H100.optimizer_efficiency > H100.memory_efficiency   # few large kernels beat many small ones


def test_compute_symbolic():
    m, n = sympy.symbols("m n", positive=True)
    flops = cm.matmul_flops(m, n, 1024)
    t = cm.compute_time(cm.TRAIN_FLOPS_FACTOR * flops, "bfloat16", H100)
    assert t.subs({m: 512, n: 256}) == pytest.approx(3 * 2 * 512 * 256 * 1024 / 989e12)
    assert cm.memory_time(4 * m, H100).subs(m, 10) == pytest.approx(40 / (3.35e12 * H100.memory_efficiency))


def test_flops_per_second_fallbacks():
    assert H100.flops_per_second("bfloat16") == 989e12
    assert H100.flops_per_second("torch.bfloat16") == 989e12
    assert H100.flops_per_second("float64") == 494.5e12  # unknown -> float32
    hw = Hardware("x", {"bfloat16": 2e12, "float16": 3e12}, 2**30, 1e9, Link(1e9, 1e-6), Link(1e8, 1e-5))
    assert hw.flops_per_second("int8") == 3e12  # no float32 -> best


# --- hardware ---------------------------------------------------------------

def test_presets_figures():
    assert H100.memory_bytes == 80 * 2**30
    assert H100.intra_node_link.bandwidth == 18 * 20.6e9 and H100.inter_node_link.bandwidth == 50e9   # NCCL's NVLink 4
    a100 = cm.PRESETS["a100"]
    assert a100.flops_per_second("float32") == 156e12 and a100.memory_bandwidth == 2.039e12
    cpu = cm.PRESETS["cpu"]
    assert cpu.intra_node_link == cpu.inter_node_link == Link(5e9, 20e-6)
    gloo = cm.PRESETS["cpu-gloo"]
    assert gloo.intra_node_link == gloo.inter_node_link == Link(1e9, 5e-4, {"reduce_scatter": Link(0.25e9, 5e-4)})
    # gloo reduce-scatters by all-reducing the whole buffer: slower than its all-reduce, whose bytes are twice
    nbytes = 8 * 2**20
    assert cm.collective_time("reduce_scatter", nbytes, 2, gloo.intra_node_link) > \
        cm.collective_time("all_reduce", nbytes, 2, gloo.intra_node_link)
    for hw in cm.PRESETS.values():
        assert hw.intra_node_link.bandwidth >= hw.inter_node_link.bandwidth
        hash(hw)  # frozen and hashable, so plans can key caches on it


def test_get_hardware():
    assert cm.get_hardware("H100") is H100
    assert cm.get_hardware(None) is H100
    assert cm.get_hardware(None, default="a100") is cm.PRESETS["a100"]
    custom = Hardware("mine", {"float32": 1e12}, 2**30, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))
    assert cm.get_hardware(custom) is custom
    with pytest.raises(CostModelError, match="a100, cpu, cpu-gloo, h100, h100-hbm2e, h200, tpu-v5p"):
        cm.get_hardware("b200")


def test_h200_preset_figures():
    # H200 SXM 141GB: the H100's die (same dense peaks), more and faster HBM, same links
    h200 = cm.PRESETS["h200"]
    assert h200.name == "h200"
    assert h200.flops_per_second("bfloat16") == h200.flops_per_second("float16") == 989e12
    assert h200.flops_per_second("float32") == 494.5e12          # TF32 tensor cores
    assert h200.memory_bytes == 141 * 2**30 and h200.memory_bandwidth == 4.8e12
    assert h200.intra_node_link == H100.intra_node_link           # NVLink 4: 370.8 GB/s per direction by NCCL
    assert h200.inter_node_link.bandwidth == 50e9                 # 400 Gb/s InfiniBand
    assert h200.devices_per_node == 8


def test_h100_hbm2e_preset_figures():
    # torchtitan's cluster: the 96 GB HBM2e H100 at 2.4 TB/s, capped at 500 W; NVLink 4 in a host, 400 Gb/s RDMA
    hbm2e = cm.PRESETS["h100-hbm2e"]
    assert hbm2e.memory_bytes == 96 * 2**30 and hbm2e.memory_bandwidth == 2.4e12
    # the 700 W SXM's peak at the clock a 500 W cap allows, f ~ P^(1/3)
    assert hbm2e.flops_per_second("bfloat16") == pytest.approx(989e12 * (500 / 700) ** (1 / 3), rel=1e-3)
    assert hbm2e.flops_per_second("float32") == pytest.approx(hbm2e.flops_per_second("bfloat16") / 2)
    assert hbm2e.intra_node_link == H100.intra_node_link and hbm2e.inter_node_link == H100.inter_node_link
    assert hbm2e.devices_per_node == 8
    # the die's measured shares; the memory-bound share is higher at the lower bandwidth (a fixed cost per kernel)
    assert hbm2e.matmul_efficiency == H100.matmul_efficiency
    assert hbm2e.memory_efficiency > H100.memory_efficiency > cm.PRESETS["h200"].memory_efficiency


def test_tpu_v5p_preset_figures():
    v5p = cm.PRESETS["tpu-v5p"]
    assert v5p.flops_per_second("bfloat16") == 459e12
    assert v5p.flops_per_second("float32") == pytest.approx(459e12 / 3)  # bf16_3x passes
    assert v5p.memory_bytes == 95 * 2**30 and v5p.memory_bandwidth == 2.765e12
    # 4,800 Gb/s ICI = 600 GB/s each way over 6 links; a ring along one torus dim uses 2 of them
    assert v5p.intra_node_link.bandwidth == 2 * (4800e9 / 8 / 6)
    assert v5p.inter_node_link.bandwidth == 50e9 / 8                 # DCN 50 Gb/s per chip
    # a whole slice (up to 16x16x24 chips) is on ICI; an axis reaching past it crosses DCN
    links = cm.axis_links([("dcn", 2), ("dp", 64), ("tp", 64)], v5p)
    assert links == {"dcn": v5p.inter_node_link, "dp": v5p.intra_node_link, "tp": v5p.intra_node_link}


@pytest.mark.parametrize("name", ["h200", "H200", " h200 ", "tpu-v5p", "TPU-v5p", "TPU-V5P"])
def test_get_hardware_new_presets_case_insensitive(name):
    assert cm.get_hardware(name) is cm.PRESETS[name.strip().lower()]


def test_peak_flops_stored_frozen():
    flops = {"float32": 1e12}
    hw = Hardware("mine", flops, 2**30, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))
    flops["float32"] = 5.0  # mutating the caller's dict must not change the spec
    assert hw.flops_per_second("float32") == 1e12
    assert hw == Hardware("mine", {"float32": 1e12}, 2**30, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))


@pytest.mark.parametrize("bandwidth,latency", [(0, 1e-6), (-1e9, 1e-6), (1e9, 0), (1e9, -1.0)])
def test_link_validation(bandwidth, latency):
    with pytest.raises(CostModelError):
        Link(bandwidth, latency)


def test_hardware_validation():
    with pytest.raises(CostModelError, match="peak_flops"):
        Hardware("bad", {}, 2**30, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))
    with pytest.raises(CostModelError):
        Hardware("bad", {"float32": 1e12}, 0, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))


def _kinds(links, hw=H100):
    return {axis: ("intra" if link == hw.intra_node_link else "inter") for axis, link in links.items()}


@pytest.mark.parametrize("axes,expected", [
    ([("dp", 16), ("tp", 8)], {"dp": "inter", "tp": "intra"}),
    ([("a", 2), ("b", 2)], {"a": "intra", "b": "intra"}),
    ([("pp", 4), ("dp", 32), ("tp", 8)], {"pp": "inter", "dp": "inter", "tp": "intra"}),
    ([("dp", 4), ("tp", 2)], {"dp": "intra", "tp": "intra"}),
    ([("dp", 8), ("tp", 2)], {"dp": "inter", "tp": "intra"}),
    ([("dp", 64)], {"dp": "inter"}),
    ([("dp", 8)], {"dp": "intra"}),
])
def test_axis_links_default_topology(axes, expected):
    links = cm.axis_links(axes, H100)
    assert list(links) == [name for name, _ in axes]
    assert _kinds(links) == expected


def test_axis_links_overrides():
    fast = Link(1e12, 1e-7)
    links = cm.axis_links([("dp", 16), ("tp", 8)], H100, links={"dp": fast})
    assert links == {"dp": fast, "tp": H100.intra_node_link}
    with pytest.raises(CostModelError, match=r"'pq'.*\['dp', 'tp'\]"):
        cm.axis_links([("dp", 16), ("tp", 8)], H100, links={"pq": fast})


@given(sizes=st.lists(st.integers(1, 16), min_size=1, max_size=4))
def test_axis_links_property(sizes):
    axes = [(f"ax{i}", size) for i, size in enumerate(sizes)]
    kinds = _kinds(cm.axis_links(axes, H100))
    for i in range(len(sizes)):  # intra exactly when this axis and all inner ones fit a node
        inner = math.prod(sizes[i:])
        assert kinds[f"ax{i}"] == ("intra" if inner <= H100.devices_per_node else "inter")


# --- memory -----------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("70GiB", 70 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20),
    ("1.5TiB", 3 * 2**39), ("100kB", 100_000), ("12345", 12345), ("7 b", 7),
    (" 2 gib ", 2 * 2**30), ("1.1GB", 1_100_000_000), ("4KiB", 4096), ("3TB", 3 * 10**12),
    (2048, 2048), (1.5e9, 1_500_000_000),
])
def test_parse_bytes(text, expected):
    got = cm.parse_bytes(text)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("bad", ["", "GiB", "70 GiBs", "seventy", "1.2.3GB", "-5GB", "5 XB", None, True, -1, float("nan")])
def test_parse_bytes_errors(bad):
    with pytest.raises(CostModelError, match="e.g."):
        cm.parse_bytes(bad)


@given(n=st.integers(0, 2**50), unit=st.sampled_from(sorted(cm.memory.UNITS)))
def test_parse_bytes_round_trip(n, unit):
    written = f"{n}{unit.upper()}"
    assert cm.parse_bytes(written) == n * cm.memory.UNITS[unit]


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                    (1.5 * 2**30, "1.50 GiB"), (80 * 2**30, "80.00 GiB"),
                                    (3 * 2**40, "3.00 TiB"), (-2048, "-2.00 KiB")])
def test_format_bytes(n, text):
    assert cm.format_bytes(n) == text


@given(n=st.integers(1024, 2**50))
def test_format_then_parse_close(n):
    assert cm.parse_bytes(cm.format_bytes(n).replace(" ", "")) == pytest.approx(n, rel=0.01)


def test_no_torch_or_autopar_imports():
    import pathlib
    import re
    src = pathlib.Path(cm.__file__).parent
    for path in src.glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), re.M)
        assert not [m for m in imports if m.split(".")[0] in ("torch", "autopar")], path


def test_a_compiled_step_keeps_the_fused_share_of_the_memory_bound_ops():
    """Predicted.compiled_step_time = step_time less (1 - compiled_memory_fraction) of the memory-bound ops'
    time: matmuls, attention and the optimizer (outside the compiled module) are priced alike."""
    import dataclasses

    import torch

    import autopar
    from autopar.testing import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))

    def predicted(**shares):
        hw = dataclasses.replace(H100, **shares)
        return autopar.plan(model, (idx,), {"dp": 2}, hardware=hw, strategy="ddp").predicted

    none, half, all_fused = (predicted(compiled_memory_fraction=f) for f in (1.0, 0.5, 1e-9))
    assert none.compiled_step_time == pytest.approx(none.step_time)
    memory_bound = none.step_time - all_fused.compiled_step_time
    assert 0 < memory_bound < none.compute_time   # the GPT has matmuls too
    assert half.compiled_step_time == pytest.approx(half.step_time - memory_bound / 2)
    assert half.step_time == pytest.approx(none.step_time) and half.optimizer_time == none.optimizer_time


def test_the_fused_time_says_which_part_of_the_model_saves_it():
    """Predicted.fused_time splits the compiled saving by region (cost/predict.COMPILE_REGIONS), so a job that
    compiles only its transformer blocks, as torchtitan does, reads its own saving: the blocks' share grows with
    the number of blocks, the head's (final norm, output, the loss in the graph) does not, and the regions sum
    to step_time - compiled_step_time, also through the plan's JSON."""
    import torch

    import autopar
    from autopar.testing import GPT, GPTConfig, gpt_loss

    class WithLoss(torch.nn.Module):
        def __init__(self, n_layer):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))

        def forward(self, idx, targets):
            return gpt_loss(self.gpt(idx), targets)

    idx = torch.randint(0, 64, (4, 16))
    fused = {}
    for n_layer in (2, 4):
        plan = autopar.plan(WithLoss(n_layer), (idx, idx.clone()), {"dp": 2}, hardware=H100, strategy="ddp")
        p = plan.predicted
        assert set(p.fused_time) == {"blocks", "head", "other"}
        assert sum(p.fused_time.values()) == pytest.approx(p.step_time - p.compiled_step_time)
        assert autopar.Plan.from_json(plan.to_json()).predicted.fused_time == pytest.approx(p.fused_time)
        fused[n_layer] = p.fused_time
    assert fused[2]["head"] > 0 and fused[2]["blocks"] > 0
    assert fused[4]["blocks"] == pytest.approx(2 * fused[2]["blocks"])
    assert fused[4]["head"] == pytest.approx(fused[2]["head"]) and fused[4]["other"] == pytest.approx(fused[2]["other"])
    # a model without repeated blocks has no blocks to compile
    lone = autopar.plan(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()), (torch.randn(8, 32),),
                        {"dp": 2}, hardware=H100, strategy="ddp").predicted
    assert lone.fused_time["blocks"] == 0 and lone.fused_time["other"] > 0
