"""What-if queries (autopar.max_batch, autopar.min_compute_bound_batch) against closed forms derived by hand.

The model is two bias-free linears, 64 -> 128 -> 64, fp32, on the meta device:
no elementwise op, so every compute term is a matmul (3 x FLOPs / peak) and no
memory-bandwidth term appears. The hardware has round numbers: 1e12 FLOP/s,
and every axis of these 4-device meshes is inside one node (8 devices per
node), so every collective uses the intra-node link: 1e10 B/s, 1e-5 s per ring
step. A ring collective over n devices then takes 1e-5 * (n - 1) + moved / 1e10
seconds, moved = (n-1)/n * B for all-gather / reduce-scatter and 2(n-1)/n * B
for all-reduce, B being the whole tensor along the axis (cost_models.comm).
"""
import pytest
import sympy
import torch
from torch import nn

import autopar
import cost_models as cm
from autopar.testing import GPT, MLP, GPTConfig

BATCH = torch.export.Dim("batch")
SEQ = torch.export.Dim("seq")
HW = cm.Hardware("round", {"float32": 1e12}, 2**40, 1e11, intra_node_link=cm.Link(1e10, 1e-5),
                 inter_node_link=cm.Link(1e9, 1e-4))
b = sympy.Symbol("batch", integer=True, positive=True)

# weights: 64 x 128 = 8192 fp32 elements = 32768 bytes each, two of them
WEIGHT_BYTES = 64 * 128 * 4


def _two_linears():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))


def _plan(strategy, mesh, *, dynamic=True, shape=(8, 64), dims=None, model=None, **kwargs):
    x = torch.empty(*shape, device="meta")
    dynamic_shapes = {"input": dims or {0: BATCH}} if dynamic else None
    return autopar.plan(model or _two_linears(), (x,), mesh, strategy=strategy, hardware=HW,
                        dynamic_shapes=dynamic_shapes, **kwargs)


def _at(expr, batch):
    return sympy.sympify(expr).subs(b, batch)


@pytest.fixture(scope="module")
def fsdp_tp():
    return _plan("fsdp+tp", {"dp": 2, "tp": 2})


@pytest.fixture(scope="module")
def ddp():
    return _plan("ddp", {"dp": 4})


# --- FSDP (dp=2) + Megatron TP (tp=2) -----------------------------------------
#
# The captured graph is two ops: linear(x, W0) -> h [B, 128], linear_1(h, W1) -> y [B, 64],
# y the module's output. Layout (asserted below, so the derivation's premises are checked):
# layer 0 is column-parallel (W0 [128, 64] split on its output dim over tp), layer 1
# row-parallel (W1 [64, 128] split on its input dim over tp, output y partial sums P over tp);
# both weights are also split over dp (FSDP) and gathered whole over dp for use. The batch
# is split over dp only: 2 shards. Per device, B the global batch:
#
# Parameters (one tp shard of each weight, split again over dp: 1/4 of each):
#   params    2 weights * 32768 / 4                     = 16384
#   grads     same layout, fp32                         = 16384
#   optimizer AdamW, 2 fp32 moments                     = 32768
# Activations, what autograd keeps, by storage (activations.py); the weights themselves are
# parameter memory and FSDP re-gathers them for backward, so neither linear keeps a weight:
#   linear keeps its input x (W0 needs a gradient), as it takes it: x is split over dp
#     (the batch) and whole over tp (column-parallel reads all of k):
#     [B/2, 64] fp32 = B/2 * 64 * 4                     = 128 B
#   linear_1 keeps its input h (W1 needs a gradient), as it takes it: split over dp and,
#     row-parallel, on its contracted dim 128 over tp: [B/2, 64] fp32 = 128 B
#   (x's input gradient is never needed: x does not require grad)
#   activations                                         = 256 B
# Transient, the largest forward working set (liveness.py): what is alive at an op and not
# kept by autograd, plus the weights gathered whole over dp around it. Each weight is an FSDP
# layer of its own ("0", "1": items of the Sequential, cost/layer_groups.py); a layer is
# gathered at its first use, which also launches the next layer's gather (the prefetch), and
# lives to its last use. A weight gathered over dp, still split over tp, is
# [128/2, 64] = [64, 128/2] fp32 = 16384 bytes.
#   at linear:   h is being made but is kept (counted above); W0 gathered, W1 prefetched
#                                                                        -> 32768
#   at linear_1: h kept; y (lives to the end: the loss reads it), partial sums [B/2, 64]
#                fp32 = 128 B; W1 (W0's last use has passed)              -> 16384 + 128 B
#   backward's start (liveness.backward_start): y's gradient, as returned (all-reduced over tp,
#                split over dp) 128 B, and what linear_1's backward makes: h's gradient as it reads
#                h, 128 B, and W1's, gathered over dp, 16384                     -> 16384 + 256 B
#   transient = Max(32768, 16384 + 256 B) (backward's start covers linear_1's 16384 + 128 B):
#   linear peaks below B = 64, backward's start above (the symbolic form keeps both, so
#   max_batch is the cost model's own at every batch)
#   total = 16384 + 16384 + 32768 + 256 B + transient = 65536 + 256 B + Max(32768, 16384 + 256 B)
#         = 98304 + 256 B up to B = 64, 81920 + 512 B from there
# Compute (3 x forward FLOPs at 1e12):
#   layer 0: local [B/2, 64] out, k = 64:  2 * (B/2 * 64) * 64 = 4096 B FLOPs
#   layer 1: local [B/2, 64] out, k = 128/2: 4096 B FLOPs
#   3 * 8192 B / 1e12 = 2.4576e-8 B seconds
# Communication:
#   dp: all-gather W0, W1 forward; all-gather W1 again in backward (layer 1 needs it for
#       the input gradient; layer 0's input needs none); reduce-scatter both gradients:
#       5 collectives of B = 16384 bytes (a tp shard), n = 2: 1e-5 + 8192 / 1e10 each
#       -> 5 * 1.08192e-5 = 5.4096e-5 s, independent of the batch
#   tp: all-reduce of layer 1's partial output [B/2, 64] fp32 = 128 B bytes, n = 2:
#       1e-5 + 2 * (1/2) * 128 B / 1e10 = 1e-5 + 1.28e-8 B s
# Compute covers
#   dp when 2.4576e-8 B >= 5.4096e-5        <=> B >= 2201.17
#   tp when 2.4576e-8 B >= 1e-5 + 1.28e-8 B <=> B >= 1e-5 / 1.1776e-8 = 849.18
#   -> the smallest even B from which both hold: 2202
# Largest batch within 100,000 bytes: 98304 + 256 B <= 100000 <=> B <= 6.6 -> even: 6
#   (6: 98304 + 1536 = 99840 fits; 8: 98304 + 2048 = 100352 does not).
# Within 1 MiB: 512 B <= 1048576 - 81920 = 966656 <=> B <= 1888, exactly at the limit.
# Within 1040 KiB = 1064960: 512 B <= 983040 <=> B <= 1920, exactly at the limit;
#   within 1000 KiB = 1024000: 512 B <= 942080 <=> B <= 1840; 1838 without the limit's last bytes.

def test_fsdp_tp_layout_and_terms_match_the_derivation(fsdp_tp):
    plan = fsdp_tp
    assert plan.batch_axes == ("dp",)
    assert plan.param_placements == {"0.weight": ("S(1)", "S(0)"), "1.weight": ("S(0)", "S(1)")}
    s = plan.symbolic
    m = s.memory
    assert (m.params, m.grads, m.optimizer) == (16384, 16384, 32768)
    assert sympy.expand(m.activations - 256 * b) == 0
    assert m.transient == sympy.Max(32768, 16384 + 256 * b)
    assert sympy.expand(m.total - (65536 + 256 * b + sympy.Max(32768, 16384 + 256 * b))) == 0
    assert plan.predicted.memory.total == 98304 + 256 * 8  # the example batch: linear peaks
    assert float(_at(s.compute_time, 1)) == pytest.approx(2.4576e-8, rel=1e-12)
    assert sympy.sympify(s.comm_time["dp"]).free_symbols == set()
    assert float(s.comm_time["dp"]) == pytest.approx(5 * (1e-5 + 8192 / 1e10), rel=1e-12)
    tp = sympy.expand(s.comm_time["tp"])
    assert float(tp.coeff(b, 0)) == pytest.approx(1e-5, rel=1e-12)
    assert float(tp.coeff(b, 1)) == pytest.approx(128 / 1e10, rel=1e-12)


def test_fsdp_tp_min_compute_bound_batch(fsdp_tp):
    s = fsdp_tp.symbolic
    assert autopar.min_compute_bound_batch(fsdp_tp) == 2202
    # 2202 covers both axes, 2200 (the even batch below) leaves dp uncovered
    assert all(_at(s.compute_time, 2202) >= _at(t, 2202) for t in s.comm_time.values())
    assert _at(s.compute_time, 2200) < _at(s.comm_time["dp"], 2200)


@pytest.mark.parametrize("limit,expected", [(100_000, 6), ("1MiB", 1888), ("1040KiB", 1920), (1023999, 1838)])
def test_fsdp_tp_max_batch(fsdp_tp, limit, expected):
    assert autopar.max_batch(fsdp_tp, limit) == expected
    total = fsdp_tp.symbolic.memory.total
    assert _at(total, expected) <= cm.parse_bytes(limit) < _at(total, expected + 2)  # 2 batch shards


def test_fsdp_tp_symbolic_memory_is_the_prediction_at_another_batch():
    # the expression made at B = 8 keeps both candidate peaks, so it is what the cost model predicts
    # for a plan made at B = 1920, where backward's start peaks: 81920 + 512 * 1920 = 1064960
    plan = _plan("fsdp+tp", {"dp": 2, "tp": 2}, dynamic=False, shape=(1920, 64))
    assert plan.param_placements == {"0.weight": ("S(1)", "S(0)"), "1.weight": ("S(0)", "S(1)")}
    assert plan.predicted.memory.transient == 16384 + 256 * 1920
    assert plan.predicted.memory.total == 1064960


# --- DDP on dp=4 ----------------------------------------------------------------
#
# Memory, weights whole on each device:
#   params 2 * 32768 = 65536, grads 65536, optimizer (AdamW, 2 moments) 131072 -> 262144
#   activations: linear keeps x split over dp: [B/4, 64] fp32 = 64 B;
#                linear_1 keeps h split over dp: [B/4, 128] fp32 = 128 B     -> 192 B
#   transient: no weight is gathered; at linear nothing alive is unkept (h is kept);
#              at linear_1 the output y [B/4, 64] fp32 = 64 B; backward's start: y's gradient 64 B,
#              h's [B/4, 128] 128 B and W1's whole 32768, which its bucket takes after
#                                                                            -> 32768 + 192 B
#   total = 262144 + 192 B + 32768 + 192 B = 294912 + 384 B
# Compute: layer 0 [B/4, 128] out, k = 64: 4096 B FLOPs; layer 1 [B/4, 64] out, k = 128:
#   4096 B FLOPs; 3 * 8192 B / 1e12 = 2.4576e-8 B s (the same total as above).
# Communication, dp: both gradients in one bucket (cost/buckets.py, 25 MiB), one all-reduce of
#   B = 65536 bytes, n = 4: 1e-5 * 3 + 2 * 3/4 * 65536 / 1e10 = 3e-5 + 9.8304e-6 s = 3.98304e-5 s
# Compute covers dp when 2.4576e-8 B >= 3.98304e-5 <=> B >= 1620.7 -> multiple of 4: 1624.
# Largest batch within 350,000 bytes: 384 B <= 55088 <=> B <= 143.46 -> multiple of 4: 140
#   (140: 294912 + 53760 = 348672 fits; 144: 294912 + 55296 = 350208 does not).

def test_ddp_terms_match_the_derivation(ddp):
    s = ddp.symbolic
    assert ddp.batch_axes == ("dp",)
    m = s.memory
    assert (m.params, m.grads, m.optimizer) == (65536, 65536, 131072)
    assert sympy.expand(m.activations - 192 * b) == 0
    assert sympy.expand(m.transient - (32768 + 192 * b)) == 0
    assert sympy.expand(m.total - (294912 + 384 * b)) == 0
    assert float(_at(s.compute_time, 1)) == pytest.approx(2.4576e-8, rel=1e-12)
    assert float(s.comm_time["dp"]) == pytest.approx(3e-5 + 1.5 * 2 * WEIGHT_BYTES / 1e10, rel=1e-12)


def test_ddp_min_compute_bound_batch(ddp):
    s = ddp.symbolic
    assert autopar.min_compute_bound_batch(ddp) == 1624
    assert _at(s.compute_time, 1624) >= _at(s.comm_time["dp"], 1624)
    assert _at(s.compute_time, 1620) < _at(s.comm_time["dp"], 1620)


def test_ddp_max_batch_is_a_multiple_of_the_batch_shards(ddp):
    assert autopar.max_batch(ddp, 350_000) == 140
    total = ddp.symbolic.memory.total
    assert _at(total, 140) <= 350_000 < _at(total, 144)
    assert _at(total, 143) <= 350_000  # 143 fits too (349824), but 4 ranks cannot split it evenly


def test_other_dynamic_dims_stay_at_their_example_size():
    # input [B, S, 64], S = 2 in the example; each batch term above gains a factor S:
    # activations 64 B S + 128 B S, transient 32768 + 192 B S -> 294912 + 384 B S = 294912 + 768 B
    # at S = 2, <= 350,000 <=> B <= 71.7 -> multiple of 4: 68
    plan = _plan("ddp", {"dp": 4}, shape=(8, 2, 64), dims={0: BATCH, 1: SEQ})
    assert plan.symbols == {"batch": 8, "seq": 2}
    seq = sympy.Symbol("seq", integer=True, positive=True)
    assert sympy.expand(plan.symbolic.memory.total - (294912 + 384 * b * seq)) == 0
    with pytest.raises(autopar.AutoparError, match=r"several dynamic dims \(batch, seq\).*symbol="):
        autopar.max_batch(plan, 350_000)
    assert autopar.max_batch(plan, 350_000, symbol="batch") == 68
    with pytest.raises(autopar.AutoparError, match="symbol='tokens' is not a dynamic dim"):
        autopar.min_compute_bound_batch(plan, symbol="tokens")


# --- where the peak op moves with the batch: FSDP on dp=2, 64 -> 1024 -> 8 --------------
#
# W0 [1024, 64] = 262144 bytes, W1 [8, 1024] = 32768 bytes, both split over dp and gathered
# whole for use, each an FSDP layer of its own (W1 prefetched while linear runs); the batch
# split over dp.
#   params + grads + optimizer = (262144 + 32768) / 2 * (1 + 1 + 2) = 589824
#   activations: linear keeps x [B/2, 64] = 128 B, linear_1 keeps h [B/2, 1024] = 2048 B
#   working sets: at linear W0 + W1 = 294912 (h is kept); at linear_1 W1 + y [B/2, 8] = 32768 + 16 B;
#   backward's start: y's gradient 16 B, h's [B/2, 1024] 2048 B, W1's whole 32768 = 32768 + 2064 B
#   -> linear peaks below B = (294912 - 32768) / 2064 = 127.0, backward's start above it.
# Made at B = 8, the symbolic transient keeps both: Max(294912, 32768 + 2064 B), so
#   memory.total = 589824 + 2176 B + Max(294912, 32768 + 2064 B)
# is what a plan made at any batch predicts: 884736 + 2176 B up to 127, 622592 + 4240 B above.
# Within 36503552 bytes: 622592 + 4240 B <= 36503552 <=> B <= 8462.5 -> even: 8462 (the other
# branch, 2176 B <= 35618816 <=> B <= 16369, lies above 127 and does not apply).

def _wide_then_narrow():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 1024, bias=False), nn.Linear(1024, 8, bias=False))


def test_max_batch_follows_the_peak_op_across_batches():
    plan = _plan("fsdp", {"dp": 2}, model=_wide_then_narrow())
    m = plan.symbolic.memory
    assert (m.params + m.grads + m.optimizer) == 589824
    assert sympy.expand(m.activations - 2176 * b) == 0
    assert m.transient == sympy.Max(294912, 32768 + 2064 * b)
    assert autopar.max_batch(plan, 36503552) == 8462
    for batch, transient in ((100, 294912), (200, 32768 + 2064 * 200)):
        made_there = _plan("fsdp", {"dp": 2}, dynamic=False, shape=(batch, 64), model=_wide_then_narrow())
        assert made_there.predicted.memory.transient == transient
        assert made_there.predicted.memory.total == int(_at(m.total, batch))


# --- the symbolic predictions these queries read ------------------------------------

def test_comm_time_is_per_axis_expressions_in_batch_that_survive_json(fsdp_tp):
    comm = fsdp_tp.symbolic.comm_time
    assert set(comm) == {"dp", "tp"}
    for expr in comm.values():
        assert sympy.sympify(expr).free_symbols <= {b}
    back = autopar.Plan.from_json(fsdp_tp.to_json())
    assert back.symbolic == fsdp_tp.symbolic  # exactly: the floats keep all their bits
    assert autopar.min_compute_bound_batch(back) == 2202
    assert autopar.max_batch(back, 100_000) == 6


# --- errors ------------------------------------------------------------------------------

def test_plan_without_dynamic_batch_is_refused():
    plan = _plan("ddp", {"dp": 4}, dynamic=False)
    for query in (lambda: autopar.max_batch(plan, "1GiB"), lambda: autopar.min_compute_bound_batch(plan)):
        with pytest.raises(autopar.AutoparError, match=r"no dynamic dims.*dynamic_shapes=.*torch.export.Dim"):
            query()


def test_smallest_batch_over_the_limit(fsdp_tp):
    # at B = 2 (one sample per dp shard): 98304 + 256 * 2 = 98816 bytes = 96.50 KiB > 64 KiB
    with pytest.raises(autopar.AutoparError, match=r"smallest batch this plan takes, 2 .*96.50 KiB.*64.00 KiB"):
        autopar.max_batch(fsdp_tp, "64KiB")


def test_memory_that_does_not_grow_with_the_batch():
    # x [8, S, 64], only S dynamic, pooled away by a mean before the one linear (64 -> 64), DDP on
    # dp=2. The mean keeps nothing (x does not require grad); linear keeps its input, the mean
    # [8/2, 64] = 1024 bytes; backward starts with the output's gradient [8/2, 64] = 1024 bytes and
    # the weight's 16384 (the mean's output needs none): params 16384 + grads 16384 + AdamW 32768
    # + 1024 + 1024 + 16384 = 83968 bytes = 82.00 KiB at every S.
    # (x itself, 1024 S bytes here, is a user input: the cost model counts inputs only where
    # autograd keeps them.)
    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64, bias=False)

        def forward(self, input):
            return self.lin(input.mean(1))

    with torch.device("meta"):
        model = Pool()
    plan = _plan("ddp", {"dp": 2}, model=model, shape=(8, 2, 64), dims={1: SEQ})
    assert plan.symbolic.memory.total == 83968
    with pytest.raises(autopar.AutoparError, match=r"\(82.00 KiB\) does not depend on seq.*met at every batch"):
        autopar.max_batch(plan, "1GiB")


def test_bad_memory_limit(fsdp_tp):
    with pytest.raises(autopar.AutoparError, match="memory_limit.*e.g."):
        autopar.max_batch(fsdp_tp, "lots")


def test_communication_growing_faster_than_compute_is_never_covered():
    # tp link at 1e8 B/s: the all-reduce costs 128 / 1e8 = 1.28e-6 s per sample, compute 2.4576e-8
    plan = _plan("fsdp+tp", {"dp": 2, "tp": 2}, links={"tp": cm.Link(1e8, 1e-5)})
    with pytest.raises(autopar.AutoparError, match=r"mesh axis 'tp' communication .* grows at least as fast"):
        autopar.min_compute_bound_batch(plan)


def test_axes_without_communication_are_covered_at_any_batch():
    # an axis of size 1 has no collectives: its comm_time is 0, which compute covers at any batch
    plan = _plan("ddp", {"dp": 4, "tp": 1})
    assert sympy.sympify(plan.symbolic.comm_time["tp"]).is_zero
    assert autopar.min_compute_bound_batch(plan) == 1624  # as DDP on dp=4 alone


# ----------------------------------------------------------------------------- how many devices fit

def _xxl():
    """A 220B-parameter GPT on the meta device: fp32 weights, gradients and AdamW's two states
    (16 B per parameter) are 3517.6 GB, which no dim of it divides into 37, 38 or 39 shards."""
    cfg = GPTConfig(vocab_size=24064, block_size=1024, n_layer=68, n_head=128, n_embd=16384, bias=False)
    with torch.device("meta"):
        return GPT(cfg)


def test_fsdp_weight_state_of_a_huge_model_is_its_nth_part_at_degrees_that_divide_nothing():
    model = _xxl()
    whole = 16 * sum(p.numel() for p in model.parameters())
    assert round(whole / 1e9, 1) == 3517.6
    for n in (37, 38, 39):
        idx = torch.empty((n, 8), dtype=torch.long, device="meta")
        plan = autopar.plan(model, (idx,), {"dp": n}, strategy="fsdp", optimizer="adamw", hardware="h100")
        mem = plan.predicted.memory
        state = mem.params + mem.grads + mem.optimizer
        assert mem.master == 0   # fp32: the weights are the master copy
        # a 1/n share, plus the padding of the last shard of each split dim (under 0.3% here)
        assert whole / n <= state <= whole / n * 1.003, (n, state, whole / n)
        assert all(p != ("R",) for p in plan.param_placements.values())


def test_min_axis_size_answers_the_smallest_fsdp_degree_that_fits():
    # 3517.6 GB / 37 = 95.07 GB > 95 GB; / 38 = 92.6 GB
    idx = torch.empty((1, 8), dtype=torch.long, device="meta")
    n = autopar.min_axis_size(_xxl(), (idx,), "dp", "95GB", optimizer="adamw", hardware="h100")   # fsdp
    assert n == 38


def test_min_axis_size_under_auto_and_zero():
    model, x = MLP([64, 256, 64]), torch.randn(1, 64)
    whole = 16 * sum(p.numel() for p in model.parameters())
    # auto plans each size under the limit: the whole step fits at the size it answers
    n = autopar.min_axis_size(model, (x,), "dp", whole / 3, strategy="auto")
    plan = autopar.plan(model, (x.repeat(n, 1),), {"dp": n}, memory_limit=whole / 3)
    assert 3 <= n <= 4 and plan.predicted.memory.total <= whole / 3
    # ZeRO-2 splits gradients and AdamW state (12 of 16 bytes), never the weight: 4/16 + 12/16/n is 0.625
    # of the whole at n = 2 and 0.5 at 3 (plus a few padded elements)
    assert autopar.min_axis_size(model, (x,), "dp", 0.51 * whole, strategy="zero2") == 3


def test_min_axis_size_says_when_the_strategy_splits_nothing():
    with pytest.raises(autopar.AutoparError, match="strategy 'ddp' does not split params.*use 'fsdp'"):
        autopar.min_axis_size(MLP([8, 16, 8]), (torch.randn(1, 8),), "dp", 100, strategy="ddp")


def test_the_working_set_envelope_is_the_max_of_its_parts_at_every_size():
    """predict.upper_envelope builds its Max without sympy's proofs (seconds on a Llama): it must keep a
    part wherever that part is the largest, and drop what sympy's Max drops on working sets."""
    import itertools
    from autopar.cost.predict import _max_with, upper_envelope
    s = sympy.Symbol("seq", integer=True, positive=True)
    parts = [256 * b * s, 32 * b * s + 32 * s, 320 * b * s + 4096, b * s**2 / 4 + 72 * b * s,
             2 * b * s + 32 * s + 8, 3 * b * s**2 / 4 + 8 * s, 80 * b * s + 4096, 5000 * b, 0, 4096]
    env = upper_envelope(parts)
    assert str(sympy.Max(256 * b * s, 32 * b * s + 32 * s)) == str(upper_envelope(parts[:2])) == "256*batch*seq"
    assert 5000 * b in env.args   # the largest at batch 64, seq 1: it stays
    assert 32 * b * s + 32 * s not in env.args and 0 not in env.args
    for bv, sv in itertools.product([1, 2, 5, 64], [1, 3, 128, 4096]):
        at = {b: bv, s: sv}
        assert env.subs(at) == max(p.subs(at) if isinstance(p, sympy.Expr) else p for p in parts)
    # adding a part no larger than one already there leaves the Max as it is; a larger one is kept
    assert _max_with(env, 2 * b * s) is env
    assert sympy.Max(env, b * s**3) == _max_with(env, b * s**3)
