"""Which collectives each classic launches in one training step, and whether the plan predicted them.

The parallel module logs every collective it launches (parallelize(...,
record_comm=True)); autopar.testing.parallel_record returns the log of step 1
as (kind, axis index, whole-tensor bytes, phase) records. These tests check:

- the pattern each classic promises (DDP: gradient all-reduces only; FSDP:
  all-gather forward, re-gather backward, reduce-scatter backward; TP:
  Megatron's forward all-reduce after row-parallel and backward all-reduce
  before column-parallel linears, no parameter ever gathered);
- FSDP's memory promise, seen through the log: a gathered weight is not kept
  for backward but gathered again, exactly once for every use whose other
  input needs a gradient (and never for other uses);
- for every classic and mesh: the plan's predicted bytes per axis
  (plan.predicted.comm_bytes) equal the bytes the measured collectives move,
  and the plan's list of collectives (plan.collectives) equals the measured
  multiset of (kind, axis, phase, bytes).
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

import cost_models as cm
from autopar.testing import GPT, MLP, GPTConfig, gpt_loss, parallel_record, run_threaded

AXIS_NAMES = {(2,): ("a",), (4,): ("a",), (2, 2): ("a", "b")}
MESHES = list(AXIS_NAMES)
CLASSIC_CASES = [(s, m) for s in ("ddp", "fsdp", "tp") for m in MESHES] + [("fsdp+tp", (2, 2))]

BATCH = 8
MLP_SIZES = (8, 16, 8)               # two linears
MLP4_SIZES = (8, 16, 8, 16, 8)       # four linears: column, row, column, row under TP
# sizes chosen so no parameter has as many bytes as an activation (B*T*C, B*T*4C, B*T*V),
# which lets the TP test tell a gathered weight from a gathered activation by its size
GPT_CFG = dict(vocab_size=48, block_size=8, n_layer=2, n_head=2, n_embd=16)
GPT_BATCH = 4


def mse(out, y):
    return ((out - y) ** 2).mean()


def build(kind: str):
    """(model, x, y, loss_fn), seeded; built here, never inside a rank thread."""
    torch.manual_seed(0)
    if kind.startswith("mlp"):
        sizes = MLP4_SIZES if kind == "mlp4" else MLP_SIZES
        model = MLP(sizes)
        return model, torch.randn(BATCH, sizes[0]), torch.randn(BATCH, sizes[-1]), mse
    cfg = GPTConfig(dropout=0.0, **GPT_CFG)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (GPT_BATCH, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (GPT_BATCH, cfg.block_size))
    return model, x, y, gpt_loss


@functools.lru_cache(maxsize=None)
def one_step(kind: str, strategy: str, shape: tuple):
    """Per-rank records of one training step (cached: several tests read the same run)."""
    model, x, y, loss_fn = build(kind)
    res = run_threaded(math.prod(shape), parallel_record, model, shape, AXIS_NAMES[shape], x, y, loss_fn,
                       1, 1e-4, {"strategy": strategy})
    return model, res


def per_axis(comm, names) -> dict:
    """{axis name: Counter of (kind, phase)} of one rank's log."""
    out = {a: Counter() for a in names}
    for kind, axis, _, phase in comm:
        out[names[axis]][(kind, phase)] += 1
    return out


def bytes_by(comm, names, kind, phase, axis) -> Counter:
    return Counter(b for k, a, b, p in comm if k == kind and p == phase and names[a] == axis)


def param_bytes(model) -> Counter:
    return Counter(p.numel() * p.element_size() for p in model.parameters())


def linear_weight_placements(plan, model):
    return [plan.param_placements[f"{name}.weight"]
            for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]


# ---------------------------------------------------------------- DDP

@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_ddp_all_reduces_every_gradient_once_per_axis_and_nothing_else(kind, shape):
    """Under ddp the gradients go out in buckets (runtime/reduction/grad_buckets.py): tiny models fit one 25 MiB bucket,
    so one all-reduce per axis carries every weight's gradient, once. The GPT's position embedding output is
    whole on the data axes and read by the batch-split add: its partial gradient flows on to the wpe weight
    and is reduced in the bucket with the others (cost/buckets.partial_gradients), not where backward
    meets it."""
    model, res = one_step(kind, "ddp", shape)
    names = AXIS_NAMES[shape]
    plan = res[0]["plan"]
    assert set(plan.batch_axes) == set(names), f"ddp must split the batch over every axis, got {plan.batch_axes}"
    assert all(p == "R" for pl in plan.param_placements.values() for p in pl), plan.param_placements
    for rank, r in enumerate(res):
        counts = per_axis(r["comm"], names)
        for axis in names:
            assert counts[axis] == Counter({("all_reduce", "backward"): 1}), (
                f"rank {rank}, axis {axis}: {dict(counts[axis])}; DDP launches one bucket's all-reduce in "
                f"backward and nothing in forward")
            # every gradient is reduced once: the bucket's bytes are the weights' bytes
            assert sum(bytes_by(r["comm"], names, "all_reduce", "backward", axis).elements()) == \
                sum(param_bytes(model).elements()), f"rank {rank}, axis {axis}: all-reduced bytes differ"


# ---------------------------------------------------------------- FSDP

def expected_regathers(kind, model) -> int:
    """Weight uses whose other input needs a gradient: there autograd keeps the weight for backward.

    MLP: every linear but the first (its input is the data, which needs no
    gradient, so only the weight's gradient is computed and the weight itself
    is not needed); biases never. GPT: every linear (its input comes from the
    embeddings), and layer norms keep weight and bias; embeddings keep no weight.
    """
    if kind == "mlp":
        return sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)) - 1
    n_layer = model.config.n_layer
    per_block = 6 + 4  # q, k, v, o, fc, proj weights; ln_1 and ln_2 weight and bias
    return n_layer * per_block + 2 + 1  # ln_f weight and bias, lm_head weight


FSDP_CASES = [("mlp", (2,)), ("mlp", (4,)), ("mlp", (2, 2)), ("gpt", (2,)), ("gpt", (2, 2))]


def _layer_groups(kind, model) -> dict:
    """Layer -> its parameters, as FSDP groups them on one axis (runtime/reduction/layer_groups.py): the item of a
    numbered module list a weight is in, else the root. GPT's position embedding moves alone: its
    gradient is summed as an activation's (see below), so its gather is not a gather+reduce-scatter pair."""
    groups: dict = {}
    for fqn, _ in model.named_parameters():
        parts = fqn.split(".")
        numbered = [k for k in range(len(parts) - 1) if parts[k].isdigit()]
        layer = ".".join(parts[: numbered[-1] + 1]) if numbered else "root"
        groups.setdefault("wpe" if fqn == "wpe.weight" else layer, []).append(fqn)
    return groups


@pytest.mark.parametrize("kind,shape", FSDP_CASES, ids=[f"{k}-{m}" for k, m in FSDP_CASES])
def test_fsdp_gathers_forward_regathers_backward_and_reduce_scatters(kind, shape):
    """On one axis FSDP moves a layer at a time, as FSDP2: one all-gather per layer in forward, one
    re-gather per layer in backward (for the layers whose weights autograd keeps: the gathered weights
    are not kept alive for backward), one reduce-scatter per layer. On two axes (a weight split on both,
    gathered one axis at a time) it moves one weight at a time."""
    model, res = one_step(kind, "fsdp", shape)
    names = AXIS_NAMES[shape]
    plan = res[0]["plan"]
    n_params = sum(1 for _ in model.parameters())
    assert set(plan.batch_axes) == set(names)
    # every parameter is stored split on every axis (all sizes here divide)
    for fqn, pl in plan.param_placements.items():
        assert all(p.startswith("S(") for p in pl), f"fsdp keeps {fqn} whole on some axis: {pl}"
    if len(shape) == 1:
        layers = _layer_groups(kind, model)
        kept = 2 if kind == "mlp" else len(layers) - 1   # MLP: layers.2 keeps its weight (see expected_regathers)
        per_weight = {("all_gather", "forward"): len(layers), ("reduce_scatter", "backward"): len(layers),
                      ("all_gather", "backward"): min(kept, expected_regathers(kind, model))}
    else:
        per_weight = {("all_gather", "forward"): n_params, ("reduce_scatter", "backward"): n_params,
                      ("all_gather", "backward"): expected_regathers(kind, model)}
    for rank, r in enumerate(res):
        counts = per_axis(r["comm"], names)
        for axis in names:
            expected = Counter(per_weight)
            if kind == "gpt" and counts[axis][("all_reduce", "backward")]:
                # GPT's position embedding is looked up once for the whole batch and then added to
                # the batch-split token embeddings; its gradient may be summed over the batch shards
                # as an activation (all-reduce of the [T, C] lookup's gradient) instead of as a
                # weight gradient (reduce-scatter). Allowed once, for exactly that tensor.
                T, C = GPT_CFG["block_size"], GPT_CFG["n_embd"]
                assert bytes_by(r["comm"], names, "all_reduce", "backward", axis) == Counter({T * C * 4: 1}), (
                    f"rank {rank}, axis {axis}: unexpected backward all-reduces {dict(counts[axis])}")
                expected[("reduce_scatter", "backward")] -= 1
                expected[("all_reduce", "backward")] += 1
            assert counts[axis] == expected, (
                f"rank {rank}, axis {axis}: measured {dict(counts[axis])}, expected {dict(expected)}")
        if len(shape) == 1:  # on one axis the gathers and the gradient reductions move exactly the parameters
            gathered = sum(bytes_by(r["comm"], names, "all_gather", "forward", "a").elements())
            assert gathered == sum(param_bytes(model).elements()), (
                f"rank {rank}: forward all-gathers move {gathered} bytes, the parameters are another size")
            reduced = (bytes_by(r["comm"], names, "reduce_scatter", "backward", "a")
                       + bytes_by(r["comm"], names, "all_reduce", "backward", "a"))
            assert sum(reduced.elements()) == sum(param_bytes(model).elements()), (
                f"rank {rank}: gradient reductions move other bytes than the parameters")


class _CountedReduceScatters:
    """reduce_scatter_flat as the layer groups call it, per rank: at each launch, how many launched before it
    were not yet waited on."""

    def __init__(self, reduce_scatter_flat):
        self.inner, self.pending, self.seen = reduce_scatter_flat, {}, {}

    def __call__(self, *args, **kwargs):
        import torch.distributed as dist
        pending = self.pending.setdefault(dist.get_rank(), [])
        self.seen.setdefault(dist.get_rank(), []).append(len(pending))
        work, out, pieces = self.inner(*args, **kwargs)
        return _CountedWork(work, pending), out, pieces


class _CountedWork:
    def __init__(self, work, pending: list):
        self.work, self.pending = work, pending
        pending.append(self)

    def wait(self):
        self.pending.remove(self)
        return self.work.wait()


def _fsdp_backward(rank, model, x, y):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    pm = autopar.parallelize(model, init_device_mesh("cpu", (2,), mesh_dim_names=("a",)), (x,), strategy="fsdp")
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    gpt_loss(pm(xi), yi).backward()


def test_fsdp_backward_holds_one_layer_reduce_scatter_in_flight(monkeypatch):
    """Each layer's reduce-scatter holds the layer's whole gradients until it completes: launching the next
    first waits for it (runtime/reduction/layer_groups.InFlight), so backward never holds every layer's at once. (It
    did: a 16-layer GPT's step peaked at 1.4x the predicted memory; benchmarks/peak_memory.py.)"""
    import autopar.runtime.reduction.layer_groups as lg
    counted = _CountedReduceScatters(lg.reduce_scatter_flat)
    monkeypatch.setattr(lg, "reduce_scatter_flat", counted)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**GPT_CFG, "n_layer": 4}))
    x, y = torch.randint(0, 48, (BATCH, 8)), torch.randint(0, 48, (BATCH, 8))
    run_threaded(2, _fsdp_backward, model, x, y)
    for rank in (0, 1):
        seen = counted.seen[rank]
        assert len(seen) >= 5, seen   # four blocks and the root, each its own reduce-scatter
        assert max(seen) == 0 and not counted.pending[rank], (seen, counted.pending[rank])


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fsdp_predicted_regathers_match_the_weights_autograd_keeps(kind):
    """The plan's backward all-gathers are the re-gathers counted above, no more, no fewer."""
    model, res = one_step(kind, "fsdp", (2,))
    plan = res[0]["plan"]
    predicted = sum(1 for c in plan.collectives if c.kind == "all_gather" and c.phase == "backward")
    measured = sum(1 for k, _, _, p in res[0]["comm"] if k == "all_gather" and p == "backward")
    assert 0 < measured <= expected_regathers(kind, model)   # a layer at a time
    assert predicted == measured, (
        f"plan predicts {predicted} backward re-gathers, the module launches {measured}: "
        + "; ".join(f"{c.where}:{c.bytes:.0f}" for c in plan.collectives
                    if c.kind == "all_gather" and c.phase == "backward"))


# ---------------------------------------------------------------- TP (Megatron)

def test_tp_mlp_is_megatron():
    model, res = one_step("mlp4", "tp", (2,))
    plan = res[0]["plan"]
    assert plan.batch_axes == (), f"tp must not split the batch, got {plan.batch_axes}"
    weights = linear_weight_placements(plan, model)
    assert weights == [("S(0)",), ("S(1)",), ("S(0)",), ("S(1)",)], (
        f"linear weights should alternate column (S(0), out features) / row (S(1), in features): {weights}")
    biases = [plan.param_placements[f"layers.{i}.bias"] for i in (0, 2, 4, 6)]
    assert biases == [("S(0)",), ("R",), ("S(0)",), ("R",)], f"column biases split, row biases whole: {biases}"
    B = BATCH
    for rank, r in enumerate(res):
        counts = per_axis(r["comm"], ("a",))["a"]
        # forward: one all-reduce after each row-parallel linear; backward: one for the input of
        # the second column-parallel linear (the first one's input, the data, needs no gradient)
        assert counts == Counter({("all_reduce", "forward"): 2, ("all_reduce", "backward"): 1}), (
            f"rank {rank}: {dict(counts)}")
        assert bytes_by(r["comm"], ("a",), "all_reduce", "forward", "a") == Counter({B * 8 * 4: 2})
        assert bytes_by(r["comm"], ("a",), "all_reduce", "backward", "a") == Counter({B * 8 * 4: 1})


def test_tp_two_layer_mlp_reduces_once_forward_and_never_backward():
    model, res = one_step("mlp", "tp", (2,))
    plan = res[0]["plan"]
    assert linear_weight_placements(plan, model) == [("S(0)",), ("S(1)",)]
    for r in res:
        assert per_axis(r["comm"], ("a",))["a"] == Counter({("all_reduce", "forward"): 1}), r["comm"]


def test_tp_gpt_is_megatron():
    model, res = one_step("gpt", "tp", (2,))
    plan = res[0]["plan"]
    pp = plan.param_placements
    n_layer = GPT_CFG["n_layer"]
    assert plan.batch_axes == ()
    for i in range(n_layer):
        h = f"h.{i}"
        for col in ("attn.q", "attn.k", "attn.v", "fc"):
            assert pp[f"{h}.{col}.weight"] == ("S(0)",), f"{h}.{col}.weight should be column-parallel: {pp}"
        for row in ("attn.o", "proj"):
            assert pp[f"{h}.{row}.weight"] == ("S(1)",), f"{h}.{row}.weight should be row-parallel: {pp}"
            assert pp[f"{h}.{row}.bias"] == ("R",), f"{h}.{row}.bias is added once after the reduction"
        for col_bias in ("attn.q", "attn.v", "fc"):
            assert pp[f"{h}.{col_bias}.bias"] == ("S(0)",)
    lm_head_column = pp["lm_head.weight"] == ("S(0)",)
    weight_sizes = set(param_bytes(model))
    for rank, r in enumerate(res):
        counts = per_axis(r["comm"], ("a",))["a"]
        assert counts[("all_reduce", "forward")] == 2 * n_layer, (
            f"rank {rank}: one forward all-reduce after each attention output and MLP projection: {dict(counts)}")
        assert counts[("all_reduce", "backward")] == 2 * n_layer + lm_head_column, (
            f"rank {rank}: one backward all-reduce before each block's q/k/v and fc "
            f"(and lm_head if vocab-parallel): {dict(counts)}")
        others = {k: n for k, n in counts.items()
                  if k not in {("all_reduce", "forward"), ("all_reduce", "backward"), ("all_gather", "forward")}}
        assert not others, f"rank {rank}: TP launches no {others}"
        gathered = bytes_by(r["comm"], ("a",), "all_gather", "forward", "a")
        assert not (set(gathered) & weight_sizes), (
            f"rank {rank}: forward all-gathers of {sorted(gathered)} bytes look like parameters "
            f"(sizes {sorted(weight_sizes)}); TP uses weights as stored")


# ---------------------------------------------------------------- FSDP + TP

def test_fsdp_tp_roles_per_axis():
    for kind in ("mlp", "gpt"):
        model, res = one_step(kind, "fsdp+tp", (2, 2))
        plan = res[0]["plan"]
        assert plan.batch_axes == ("a",), f"{kind}: fsdp+tp splits the batch over the fsdp axis only"
        for rank, r in enumerate(res):
            counts = per_axis(r["comm"], ("a", "b"))
            assert counts["a"][("all_reduce", "forward")] == 0, f"{kind} rank {rank}: fsdp axis reduces activations"
            assert counts["a"][("all_gather", "forward")] > 0 and counts["a"][("reduce_scatter", "backward")] > 0
            assert counts["b"][("reduce_scatter", "backward")] == 0 and counts["b"][("all_gather", "backward")] == 0, (
                f"{kind} rank {rank}: FSDP-style traffic on the tp axis: {dict(counts['b'])}")
            assert counts["b"][("all_reduce", "forward")] > 0, f"{kind} rank {rank}: no TP reduction on axis b"


# ---------------------------------------------------------------- predicted == measured, every classic

@pytest.mark.parametrize("strategy,shape", CLASSIC_CASES, ids=[f"{s}-{m}" for s, m in CLASSIC_CASES])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_predicted_collectives_equal_measured(kind, strategy, shape):
    model, res = one_step(kind, strategy, shape)
    names = AXIS_NAMES[shape]
    sizes = dict(zip(names, shape))
    plan = res[0]["plan"]
    predicted = Counter((c.kind, c.axis, c.phase, float(c.bytes)) for c in plan.collectives)
    first = res[0]["comm"]
    for rank, r in enumerate(res):
        # SPMD: every rank launches the same collectives in the same order
        assert [(k, a, b, p) for k, a, b, p in r["comm"]] == [(k, a, b, p) for k, a, b, p in first], (
            f"rank {rank} launched other collectives than rank 0")
        measured = Counter((k, names[a], p, float(b)) for k, a, b, p in r["comm"])
        assert measured == predicted, (
            f"rank {rank}: predicted but not launched {dict(predicted - measured)}; "
            f"launched but not predicted {dict(measured - predicted)}")
        moved = {a: 0.0 for a in names}
        by_kind = Counter()
        for k, a, b, _ in r["comm"]:
            n = cm.bytes_moved(k, b, shape[a])
            moved[names[a]] += n
            by_kind[k] += n
        for a in names:
            assert plan.predicted.comm_bytes.get(a, 0.0) == pytest.approx(moved[a], rel=1e-9, abs=1e-9), (
                f"rank {rank}, axis {a} (size {sizes[a]}): predicted {plan.predicted.comm_bytes.get(a)} bytes "
                f"sent per device, measured {moved[a]}")
        pk = {k: v for k, v in plan.predicted.comm_bytes_by_kind.items() if v}
        assert pk == pytest.approx({k: v for k, v in by_kind.items() if v}, rel=1e-9), (
            f"rank {rank}: predicted bytes by kind {pk}, measured {dict(by_kind)}")


def test_sequence_parallel_splits_norms_along_the_sequence_and_replaces_all_reduce():
    """tp+sp: layer norms run sequence-split; the row-parallel output is reduce-scattered, not all-reduced.
    (The head is the search's to lay out: a column-parallel head keeps the gathered final norm output as
    its shard and gathers it again in backward, so on this toy a row-parallel head, all-reduced, is cheaper.)"""
    import autopar
    from autopar.testing import GPT, GPTConfig
    torch.manual_seed(0)
    model, idx = GPT(GPTConfig()), torch.randint(0, 64, (4, 16))
    sp = autopar.plan(model, (idx,), {"tp": 2}, strategy="tp+sp")
    tp = autopar.plan(model, (idx,), {"tp": 2}, strategy="tp")
    norms = [n for n in sp.node_strategies if n.startswith("layer_norm")]
    assert norms and all(sp.node_strategies[n].output == ("S(1)",) for n in norms)   # (batch, seq, hidden)
    assert all(tp.node_strategies[n].output == ("R",) for n in norms)
    fwd = lambda plan, kind: sum(1 for c in plan.collectives if c.kind == kind and c.phase == "forward"
                                 and c.module_path.startswith("h."))
    assert fwd(tp, "all_reduce") > 0 and fwd(sp, "all_reduce") == 0
    assert fwd(sp, "reduce_scatter") > 0 and fwd(sp, "all_gather") > 0
    assert sp.predicted.memory.activations < tp.predicted.memory.activations
