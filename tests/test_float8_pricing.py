"""Float8 linears priced as they run (issue 55): the three matmuls at the hardware's float8 peak plus the casts'
bytes, the amax all-reduces among the plan's collectives, hardware without a float8 peak refused, and auto-fp8
keeping only the linears float8 speeds up. Plans of meta-device models: no ranks, no threads."""
import math
import warnings

import pytest
import sympy
import torch

import autopar
import cost_models as cm
from autopar.cost.float8 import AMAX_OF, cast_bytes, float8_linear_seconds, float8_pays, matmul_seconds
from autopar.errors import PlanError
from autopar.sharding.placement import is_shard
from autopar.testing.models import GPT, MLP, GPTConfig
from cost_models.hardware import hardware_from_dict, hardware_to_dict

MESH = {"a": 2, "b": 2}


def _plan(model, inputs, mesh=MESH, **options):
    options = {"hardware": "h100", "checkpointing": "none", **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        return autopar.plan(model, inputs, mesh, **options)


@pytest.fixture(scope="module")
def gpt():
    """A GPT whose matmuls dominate its step: width 2048, 4096 tokens per device on the 2 x 2 mesh."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=1024, n_layer=2, n_head=16, n_embd=2048))
    return model, (torch.randint(0, 256, (16, 1024), device="meta"),)


@pytest.fixture(scope="module")
def gpt_plans(gpt):
    return {(precision, strategy): _plan(*gpt, precision=precision, strategy=strategy)
            for precision in ("bf16-mixed", "fp8-mixed") for strategy in ("ddp", "tp")}


def test_presets_float8_peaks():
    # datasheet dense FP8 (3,958 TF is with sparsity); the 500 W part at the factor its bf16 figure has
    h100, h200, capped = (dict(cm.PRESETS[n].peak_flops) for n in ("h100", "h200", "h100-hbm2e"))
    assert h100[cm.FLOAT8] == h200[cm.FLOAT8] == 1979e12
    assert capped[cm.FLOAT8] == pytest.approx(1979e12 * capped["bfloat16"] / h100["bfloat16"])
    assert cm.FLOAT8 not in dict(cm.PRESETS["a100"].peak_flops)
    for name in ("cpu", "cpu-gloo"):   # emulated: at the bf16 rate
        assert dict(cm.PRESETS[name].peak_flops)[cm.FLOAT8] == dict(cm.PRESETS[name].peak_flops)["bfloat16"]


def test_custom_hardware_float8_round_trips_and_plans():
    spec = hardware_to_dict(cm.PRESETS["a100"])
    spec.update(name="my-fp8-part", peak_flops={**spec["peak_flops"], "float8": 624e12})
    hw, _ = hardware_from_dict(spec)
    assert dict(hw.peak_flops)["float8"] == 624e12
    assert hardware_from_dict(hardware_to_dict(hw))[0] == hw
    with torch.device("meta"):
        model = MLP([256, 256, 256], bias=False)
    plan = _plan(model, (torch.randn(64, 256, device="meta"),), {"a": 2}, hardware=spec, precision="fp8-mixed",
                 strategy="ddp")
    assert len(plan.float8_linears) == 2


def test_float8_on_hardware_without_it_is_refused():
    with torch.device("meta"):
        model = MLP([256, 256], bias=False)
    with pytest.raises(PlanError, match=r"'a100'.*bf16-mixed.*peak_flops\['float8'\]"):
        _plan(model, (torch.randn(64, 256, device="meta"),), {"a": 2}, hardware="a100", precision="fp8-mixed",
              strategy="ddp")


def test_price_of_one_linear():
    # 8192 tokens x 4096 -> 4096 on an H100: 3 matmuls at 1,979 TF x 0.79, and per element 2 casts (2 bytes in,
    # 1 out) + an amax read of the activation and the weight, 1 cast + a read of the gradient
    hw = cm.PRESETS["h100"]
    m, k, n = 8192, 4096, 4096
    flops = 2 * m * k * n
    pieces = ((m * k, 2), (k * n, 2), (m * n, 2))
    assert cast_bytes(pieces) == (m * k + k * n) * (2 * 3 + 2) + m * n * (3 + 2)
    want = 3 * flops / (1979e12 * hw.matmul_efficiency) + cast_bytes(pieces) / (hw.memory_bandwidth *
                                                                              hw.memory_efficiency)
    assert float8_linear_seconds(flops, pieces, hw) == pytest.approx(want, rel=1e-12)
    assert matmul_seconds(flops, "bfloat16", hw) == pytest.approx(3 * flops / (989e12 * hw.matmul_efficiency))
    # float8 pays at this shape, not at 16 x 16 over a few tokens
    assert float8_pays(m, k, n, 2, "bfloat16", hw)
    assert not float8_pays(64, 16, 16, 2, "bfloat16", hw)


def test_float8_compute_below_bf16_and_above_half(gpt_plans):
    # data parallel: each rank casts its quarter of the tokens. (Under "tp" on both axes this model's float8 is
    # the slower: every rank casts the whole activation a column-split linear reads, for a quarter of its FLOPs.)
    bf16 = gpt_plans[("bf16-mixed", "ddp")].predicted.compute_time
    fp8 = gpt_plans[("fp8-mixed", "ddp")].predicted.compute_time
    assert bf16 / 2 < fp8 < bf16


def test_symbolic_prediction_agrees(gpt_plans):
    plan = gpt_plans[("fp8-mixed", "ddp")]
    expr = sympy.sympify(plan.symbolic.compute_time)
    at = float(expr.subs({s: plan.symbols[str(s)] for s in expr.free_symbols}))
    assert at == pytest.approx(plan.predicted.compute_time, rel=1e-9)


def _amax_records(plan) -> set:
    return {(c.where, c.tensor[len(c.where):], c.axis, c.phase, c.bytes) for c in plan.collectives
            if c.tensor[len(c.where):] in AMAX_OF}


def _expected_amax(plan) -> set:
    """One all-reduce of a 2-byte scalar per split axis: activation and weight (as the op reads it) in
    forward, the output's gradient in backward; the activation's only by the first of the linears reading it
    (the query, key and value projections share one: Lowering.float8_shared_scales)."""
    out = set()
    shared = plan.schedule.lowering.float8_shared_scales
    for name in plan.float8_linears:
        s = plan.node_strategies[name]
        for placements, what, phase in ((s.inputs[0], AMAX_OF[0], "forward"), (s.inputs[1], AMAX_OF[1], "forward"),
                                         (s.output, AMAX_OF[2], "backward")):
            if name in shared and what == AMAX_OF[0]:
                continue
            out |= {(name, what, plan.mesh.axis_names[a], phase, 2.0) for a, p in enumerate(placements)
                    if is_shard(p)}
    return out


def test_amax_all_reduces_in_the_plan(gpt_plans):
    ddp = gpt_plans[("fp8-mixed", "ddp")]
    assert len(ddp.float8_linears) == 12   # 6 per block; the lm_head stays bf16 (filter_fqns)
    found = _amax_records(ddp)
    assert found == _expected_amax(ddp)
    # data parallel: the activation and the gradient split on both axes, the weight whole
    assert {(what, axis, phase) for _, what, axis, phase, _ in found} == {
        (AMAX_OF[0], "a", "forward"), (AMAX_OF[0], "b", "forward"),
        (AMAX_OF[2], "a", "backward"), (AMAX_OF[2], "b", "backward")}
    tp = gpt_plans[("fp8-mixed", "tp")]
    found = _amax_records(tp)
    assert found == _expected_amax(tp)
    assert any(what == AMAX_OF[1] for _, what, _, _, _ in found)   # tensor parallel splits weights
    assert not _amax_records(gpt_plans[("bf16-mixed", "ddp")])


def test_amax_bytes_in_predicted_comm(gpt_plans):
    # under ddp both precisions lay every tensor out alike: the comm differs by the amax all-reduces alone
    bf16, fp8 = gpt_plans[("bf16-mixed", "ddp")], gpt_plans[("fp8-mixed", "ddp")]
    for axis in MESH:
        count = sum(1 for c in fp8.collectives if c.axis == axis and c.tensor[len(c.where):] in AMAX_OF)
        extra = count * cm.bytes_moved(cm.ALL_REDUCE, 2, MESH[axis])
        assert fp8.predicted.comm_bytes[axis] - bf16.predicted.comm_bytes[axis] == pytest.approx(extra)
        # the activation's (one per set of linears reading it) and the gradient's
        assert count == 2 * len(fp8.float8_linears) - len(fp8.schedule.lowering.float8_shared_scales)
    # k and v reuse q's scale in each of the 2 blocks
    shared = fp8.schedule.lowering.float8_shared_scales
    assert sorted(fp8.module_paths[n] for n in shared) == [f"h.{i}.attn.{m}" for i in (0, 1) for m in "kv"]
    assert all(fp8.module_paths[first] == f"h.{fp8.module_paths[n][2]}.attn.q" for n, first in shared.items())


def test_auto_fp8_keeps_the_linears_float8_speeds_up():
    with torch.device("meta"):
        model = MLP([4096, 4096, 16, 16], bias=False)   # layers.0: 4096 x 4096; layers.2, layers.4: tiny
    inputs = (torch.randn(16, 1024, 4096, device="meta"),)
    auto = _plan(model, inputs, {"a": 2}, precision="auto-fp8", strategy="ddp")
    every = _plan(model, inputs, {"a": 2}, precision="fp8-mixed", strategy="ddp")
    assert [auto.module_paths[n] for n in auto.float8_linears] == ["layers.0"]
    assert [every.module_paths[n] for n in every.float8_linears] == ["layers.0", "layers.2", "layers.4"]
    assert math.isclose(auto.predicted.compute_time, every.predicted.compute_time) is False
    assert auto.predicted.compute_time < every.predicted.compute_time


def test_float8_all_gathers_move_half_the_bytes_of_bf16():
    """enable_fsdp_float8_all_gather: each float8 linear's weight is gathered at 1 byte an element (forward and
    backward's re-gather), the layer's amaxes are all-reduced once per forward on the FSDP axis (4 bytes each),
    and the linears reduce no weight amax; nothing else moves otherwise."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=1024, n_layer=2, n_head=16, n_embd=2048))
    inputs = (torch.randint(0, 256, (16, 1024), device="meta"),)
    gathered = autopar.Precision(**{**autopar.FP8_MIXED.to_dict(),
                                    "float8": autopar.Float8(enable_fsdp_float8_all_gather=True)})
    plain = _plan(model, inputs, {"dp": 4}, precision="fp8-mixed", strategy="fsdp")
    f8 = _plan(model, inputs, {"dp": 4}, precision=gathered, strategy="fsdp")
    assert len(f8.schedule.lowering.float8_gathers) == len(f8.float8_linears) == 12
    assert "12 weights all-gathered in float8" in str(f8) and "all-gathered in float8" not in str(plain)
    assert autopar.Plan.from_json(f8.to_json()).schedule.lowering.float8_gathers == f8.schedule.lowering.float8_gathers

    def gathers(plan):
        return sum(c.bytes for c in plan.collectives if c.kind == cm.ALL_GATHER)
    # q, k, v, o (2048 x 2048) and fc, proj (2048 x 8192) of 2 blocks, in elements
    linear_weights = 2 * (4 * 2048 * 2048 + 2 * 2048 * 8192)
    # each gathered twice a step (forward, and backward's re-gather), one byte less an element
    assert gathers(plain) - gathers(f8) == pytest.approx(2 * linear_weights)
    assert not any(c.tensor.endswith(AMAX_OF[1]) for c in f8.collectives)
    layer_amaxes = [c for c in f8.collectives if c.tensor.endswith(":amaxes")]
    assert sorted((c.where, c.bytes) for c in layer_amaxes) == [("layer h.0", 24.0), ("layer h.1", 24.0)]
    assert f8.predicted.comm_time["dp"] < plain.predicted.comm_time["dp"]
    # a rowwise recipe has one scale per row, not per weight: no float8 all-gather (torchao's rule)
    with pytest.raises(autopar.AutoparError, match="tensorwise"):
        autopar.Float8(recipe_name="rowwise", enable_fsdp_float8_all_gather=True)
