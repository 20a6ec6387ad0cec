"""autopar.calibrate: the alpha-beta fit, the JSON spec the planner reads, and one real (threaded) run.

The fit must invert the cost model's own collective formula (so a plan made with the fitted links
predicts the measured times), a spec must survive a round trip and change what `autopar.plan`
predicts exactly as `links=` would, a broken spec must say which file and field, and a run on two
ranks must give every rank the same positive, finite figures.
"""
import json
import math

import pytest
import torch

import autopar
import cost_models as cm
from autopar.calibrate import (DEFAULT_SIZES, KINDS, MIN_LATENCY, Calibration, axis_link, calibrate, comm_can_overlap,
                               fit_link)
from autopar.testing import MLP, run_threaded
from cost_models.hardware import hardware_from_dict, hardware_to_dict, load_hardware, resolve_hardware, save_hardware

LINK = cm.Link(bandwidth=3.7e9, latency=12e-6)
SLOW = cm.Link(bandwidth=1e6, latency=1e-3)   # far from the cpu preset's 5 GB/s, 20 us


def _synthetic(link, n, kinds=KINDS, sizes=DEFAULT_SIZES):
    return [(k, b, float(cm.collective_time(k, b, n, link))) for k in kinds for b in sizes]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_fit_recovers_the_link_that_made_the_times(n):
    fitted = fit_link(_synthetic(LINK, n), n)
    assert fitted.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-9)
    assert fitted.latency == pytest.approx(LINK.latency, rel=1e-9)


def test_fit_recovers_a_link_whose_small_all_reduces_take_the_tree():
    # on 8 ranks a node apart the tree (3 steps, 2 B) beats the ring (7 steps, 1.75 B) below ~710 KB: the
    # fit prices each point by the algorithm the model would, or it could not reproduce the times
    n, sizes = 8, DEFAULT_SIZES
    points = _synthetic(LINK, n, [cm.ALL_REDUCE], sizes)
    ring = [LINK.latency * (n - 1) + float(cm.bytes_moved(k, b, n)) / LINK.bandwidth for k, b, _ in points]
    assert sum(t < r for (_, _, t), r in zip(points, ring)) >= 2 and points[-1][2] == ring[-1]
    fitted = fit_link(points, n)
    assert fitted.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-9)
    assert fitted.latency == pytest.approx(LINK.latency, rel=1e-9)
    # the same ranks inside one node: NCCL's tree is a chain there, every point the ring
    inside = cm.Link(LINK.bandwidth, LINK.latency, ranks_per_node=n)
    fitted = axis_link({cm.ALL_REDUCE: [(b, t) for _, b, t in _synthetic(inside, n, [cm.ALL_REDUCE], sizes)]}, n, n)
    assert fitted.ranks_per_node == n
    assert fitted.for_kind(cm.ALL_REDUCE).latency == pytest.approx(LINK.latency, rel=1e-9)


def test_fit_recovers_the_link_from_one_collective_and_noisy_times():
    points = [(k, b, t * (1.02 if i % 2 else 0.98)) for i, (k, b, t) in enumerate(_synthetic(LINK, 4, [cm.ALL_GATHER]))]
    fitted = fit_link(points, 4)
    assert fitted.bandwidth == pytest.approx(LINK.bandwidth, rel=0.05)
    assert fitted.latency == pytest.approx(LINK.latency, rel=0.1)


def test_fit_clamps_a_latency_the_times_do_not_show():
    # pure bandwidth: a free fit would give latency ~0 (or below); the Link needs it positive.
    # Messages of 1 MiB and up, so the clamped 100 ns per step hardly shows in the times.
    points = [(k, b, float(cm.bytes_moved(k, b, 4)) / 2e9) for k in KINDS for b in DEFAULT_SIZES[-3:]]
    fitted = fit_link(points, 4)
    assert fitted.latency == MIN_LATENCY
    assert fitted.bandwidth == pytest.approx(2e9, rel=0.01)


def test_each_collective_kind_gets_its_own_fitted_link():
    # gloo runs a reduce-scatter as an all-reduce of the whole buffer: 3x slower per byte than its
    # all-reduce on a ring of 2. One shared link would miss both; a link per kind prices each as measured.
    slow_rs = cm.Link(LINK.bandwidth / 3, LINK.latency)
    times = {k: [(b, float(cm.collective_time(k, b, 2, slow_rs if k == cm.REDUCE_SCATTER else LINK)))
                 for b in DEFAULT_SIZES] for k in KINDS}
    link = axis_link(times, 2)
    assert link.for_kind(cm.REDUCE_SCATTER).bandwidth == pytest.approx(slow_rs.bandwidth, rel=1e-9)
    assert link.for_kind(cm.ALL_REDUCE).bandwidth == pytest.approx(LINK.bandwidth, rel=1e-9)
    assert slow_rs.bandwidth < link.bandwidth < LINK.bandwidth   # the shared fit, for kinds not timed
    for k, pts in times.items():
        for b, t in pts:
            assert float(cm.collective_time(k, b, 2, link)) == pytest.approx(t, rel=1e-9)
    assert float(cm.collective_time(cm.SEND_RECV, 1e6, 2, link)) == pytest.approx(link.latency + 1e6 / link.bandwidth)


def test_a_spec_link_with_kinds_round_trips_and_rejects_unknown_kinds(tmp_path):
    link = cm.Link(2e9, 1e-5, {cm.REDUCE_SCATTER: cm.Link(7e8, 2e-5)})
    path = tmp_path / "kinds.json"
    save_hardware(path, _hardware(), {"dp": link})
    assert load_hardware(path)[1] == {"dp": link}
    d = hardware_to_dict(_hardware(), {"dp": link})
    d["links"]["dp"]["kinds"]["all_scatter"] = {"bandwidth": 1e9, "latency": 1e-5}
    with pytest.raises(cm.CostModelError, match=r"unknown collective kind\(s\) \['all_scatter'\] in 'links.dp.kinds'"):
        hardware_from_dict(d)
    with pytest.raises(cm.CostModelError, match="must be a plain Link"):
        cm.Link(1e9, 1e-5, {cm.ALL_REDUCE: link})


def _hardware():
    return cm.Hardware("cpu-calibrated-test", {"float32": 3e10, "bfloat16": 1e10}, 6 * 2**30, 8e9,
                       cm.Link(4e9, 3e-5), cm.Link(1e9, 1e-4), devices_per_node=2)


def test_spec_round_trip(tmp_path):
    path = tmp_path / "spec.json"
    save_hardware(path, _hardware(), {"dp": LINK, "tp": SLOW}, measured={"dp": {"size": 2}})
    assert load_hardware(path) == (_hardware(), {"dp": LINK, "tp": SLOW})
    assert resolve_hardware(str(path)) == resolve_hardware(json.loads(path.read_text())) == load_hardware(path)
    assert resolve_hardware("cpu") == (cm.PRESETS["cpu"], {})


@pytest.mark.parametrize("device, ranks, threads, cores, overlaps", [
    ("cpu", 2, 1, 2, False),    # this machine's benchmark: every core computes
    ("cpu", 2, 1, 4, True),     # a core to spare for gloo's reductions
    ("cpu", 4, 2, 8, False),
    ("cuda", 8, 1, 2, True),    # NCCL runs on the GPU, whatever the host's cores
])
def test_communication_overlaps_compute_only_with_a_core_to_spare(device, ranks, threads, cores, overlaps):
    assert comm_can_overlap(device, ranks, threads, cores) is overlaps


def test_the_overlap_flag_round_trips_and_is_checked(tmp_path):
    import dataclasses
    busy = dataclasses.replace(_hardware(), comm_overlaps_compute=False)
    save_hardware(tmp_path / "busy.json", busy, {})
    assert load_hardware(tmp_path / "busy.json")[0] == busy
    d = json.loads((tmp_path / "busy.json").read_text())
    d["comm_overlaps_compute"] = "no"
    with pytest.raises(cm.CostModelError, match="comm_overlaps_compute"):
        resolve_hardware(d)


def test_attention_efficiency_prices_attention_and_round_trips(tmp_path):
    """A GPT's attention at half the matmul rate: the plan's compute grows by exactly its attention's
    time at the full rate (3 x (QK^T + PV) = 12 B T^2 C FLOPs a layer); the field survives a spec file,
    defaults to 1.0 where a spec has none, and must be positive."""
    import dataclasses
    from autopar.testing import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    torch.manual_seed(0)
    model, x = GPT(cfg), torch.randint(0, 64, (4, 16))
    full = _hardware()
    half = dataclasses.replace(full, attention_efficiency=0.5)
    t_full, t_half = (autopar.plan(model, (x,), {"dp": 1}, hardware=hw, strategy="ddp").predicted.compute_time
                      for hw in (full, half))
    attention = cfg.n_layer * 12 * 4 * 16 * 16 * cfg.n_embd / full.flops_per_second("float32")
    assert t_half - t_full == pytest.approx(attention, rel=1e-9)
    save_hardware(tmp_path / "half.json", half, {})
    assert load_hardware(tmp_path / "half.json")[0] == half
    d = json.loads((tmp_path / "half.json").read_text())
    del d["attention_efficiency"]
    assert resolve_hardware(d)[0].attention_efficiency == 1.0
    d["attention_efficiency"] = 0
    with pytest.raises(cm.CostModelError, match="attention_efficiency"):
        resolve_hardware(d)


def test_calibration_save_writes_what_the_planner_reads(tmp_path):
    cal = Calibration(_hardware(), {"dp": LINK}, {"dp": 2}, {"dp": {cm.ALL_REDUCE: [(4096, 1e-4)]}})
    cal.save(tmp_path / "cal.json")
    assert load_hardware(tmp_path / "cal.json") == (_hardware(), {"dp": LINK})


def _ddp_comm(hardware, links=None):
    model, x = MLP([16, 32, 16]), torch.randn(8, 16)
    return autopar.plan(model, (x,), {"dp": 2}, hardware=hardware, links=links, strategy="ddp").predicted


def test_plan_uses_the_spec_links_by_axis_name(tmp_path):
    path = tmp_path / "spec.json"
    save_hardware(path, _hardware(), {"dp": SLOW, "elsewhere": LINK})   # an axis the mesh lacks is ignored
    from_spec = _ddp_comm(str(path))
    assert from_spec.comm_time["dp"] == pytest.approx(_ddp_comm(_hardware(), {"dp": SLOW}).comm_time["dp"])
    assert from_spec.comm_time["dp"] > 100 * _ddp_comm("cpu").comm_time["dp"]
    assert from_spec.compute_time == pytest.approx(_ddp_comm(_hardware()).compute_time)
    # links= still wins on the axes it names; a dict works as well as a path
    assert _ddp_comm(path, {"dp": LINK}).comm_time["dp"] == pytest.approx(
        _ddp_comm(_hardware(), {"dp": LINK}).comm_time["dp"])
    assert _ddp_comm(json.loads(path.read_text())).comm_time["dp"] == pytest.approx(from_spec.comm_time["dp"])
    # and so does the Calibration itself, as autopar.calibrate returns it
    calibration = Calibration(_hardware(), {"dp": SLOW}, {"dp": 2}, {})
    assert _ddp_comm(calibration) == from_spec


def test_a_bad_spec_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "broken.json"
    spec = hardware_to_dict(_hardware(), {"dp": LINK})
    del spec["memory_bandwidth"]
    path.write_text(json.dumps(spec))
    with pytest.raises(cm.CostModelError, match=r"broken\.json.*missing field 'memory_bandwidth'"):
        load_hardware(path)
    with pytest.raises(autopar.AutoparError, match=r"broken\.json.*missing field 'memory_bandwidth'"):
        _ddp_comm(str(path))
    spec["memory_bandwidth"], spec["links"]["dp"] = 8e9, {"bandwidth": 1e9}
    with pytest.raises(cm.CostModelError, match=r"missing field 'links\.dp\.latency'"):
        hardware_from_dict(spec)
    path.write_text("{not json")
    with pytest.raises(cm.CostModelError, match=r"broken\.json.*not valid JSON"):
        load_hardware(path)
    with pytest.raises(autopar.AutoparError, match=r"missing\.json.*cannot read"):
        _ddp_comm(str(tmp_path / "missing.json"))


def test_calibrate_needs_a_device_mesh_and_a_process_group():
    with pytest.raises(autopar.MeshError, match="not initialized"):
        calibrate({"dp": 2})


def _calibrate(rank):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with pytest.raises(autopar.MeshError, match="needs a torch DeviceMesh"):
        calibrate({"dp": 2})
    return calibrate(mesh, sizes=(1024, 4096), repeats=2, quick=True)


def test_calibrate_on_two_threaded_ranks_agrees_and_is_positive():
    first, second = run_threaded(2, _calibrate)
    assert first == second
    hw, link = first.hardware, first.links["dp"]
    assert hw.name == "cpu-calibrated-threaded" and hw.devices_per_node == 2
    assert set(first.times["dp"]) == set(KINDS)
    numbers = [link.bandwidth, link.latency, hw.memory_bandwidth, hw.memory_bytes, *dict(hw.peak_flops).values(),
               hw.attention_efficiency,
               *(t for pts in first.times["dp"].values() for _, t in pts)]
    assert all(0 < v < math.inf for v in numbers), numbers
    assert "float32" in dict(hw.peak_flops)
    # float8 at the rate this CPU emulates it, so a calibrated plan can price fp8-mixed (and auto-fp8 refuse it)
    assert cm.FLOAT8 in dict(hw.peak_flops)
    assert hw.intra_node_link == link   # both ranks on one host: the axis is inside a node


def test_the_compute_shares_round_trip_and_are_checked(tmp_path):
    """The shares a step reaches of the peaks (hardware.EFFICIENCIES) travel in the spec; a spec without
    them (written before they existed) reads as 1.0, and a share that is not positive is refused."""
    import dataclasses
    measured = dataclasses.replace(_hardware(), matmul_efficiency=0.8, memory_efficiency=0.5,
                                   optimizer_efficiency=0.7, compiled_memory_fraction=0.4)
    save_hardware(tmp_path / "gpu.json", measured, {})
    assert load_hardware(tmp_path / "gpu.json")[0] == measured
    d = json.loads((tmp_path / "gpu.json").read_text())
    for field in ("matmul_efficiency", "memory_efficiency", "optimizer_efficiency", "compiled_memory_fraction"):
        old = {k: v for k, v in d.items() if k != field}
        assert getattr(hardware_from_dict(old)[0], field) == 1.0
    with pytest.raises(cm.CostModelError, match="compiled_memory_fraction"):
        dataclasses.replace(_hardware(), compiled_memory_fraction=0.0)
