"""Every sharding rule, property-tested against the unsharded op.

No process group: the ranks of a mesh are simulated in a loop. For each node
of an op under test and each of its strategies (autopar.strategies), every
simulated rank gets its local inputs from the strategy's input placements
(S(d): its chunk; R: the whole; P: a random summand, the summands over the
axis adding up to the whole), runs the op on them (shape arguments of views
divided by the split of the output dim, as the rewriter does), and the
per-rank outputs are put back together from the output placement (S: chunks
concatenated in chunk order; R: every rank must hold the same; P: summed over
the axis). The result must equal the op on the global inputs.

EXAMPLES programs are drawn per rule (10 in CI, 100 under HYPOTHESIS_PROFILE=thorough). The programs
(one tiny module per rule) are in rule_cases.py; a rule added to
autopar.sharding.rules.RULES without a case there fails test_every_rule_has_a_case.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.capture.export import capture
from autopar.mesh import MeshSpec
from autopar.sharding.placement import P, R, S, dim_factor, local_shape, shard_dim, shard_full_tensor
from autopar.runtime.lowering.rewrite import SQUEEZE_OPS, squeezed_dims
from autopar.sharding.local_ops import SHAPE_ARG_OPS
from autopar.runtime.lowering.local_ops import local_call
from autopar.sharding.rules import ring_axes, vocab_split_axes
from autopar.sharding.rules import RULES
from autopar.sharding.op_spec import op_name, tensor_args
from autopar.sharding.strategies import op_strategies

from rule_cases import CASES

MESHES = [MeshSpec(("a",), (2,)), MeshSpec(("a", "b"), (2, 2)), MeshSpec(("a",), (3,))]
RANDOM_OPS = {"aten.dropout.default", "aten.randn.default", "aten.rand.default"}
UNINITIALIZED_OPS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default"}  # only shape and dtype are defined
# programs drawn per rule: 10 in CI (each is a torch.export, ~0.15 s), 100 under HYPOTHESIS_PROFILE=thorough
# (tests/conftest.py); AUTOPAR_RULE_EXAMPLES overrides both
EXAMPLES = int(os.environ.get("AUTOPAR_RULE_EXAMPLES",
                              "100" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else "10"))


# ---------------------------------------------------------------- the global run

def record_values(cap, inputs) -> dict:
    """Every node's value when the captured program runs on `inputs` (copies: in-place ops follow)."""
    ep = cap.exported
    user = iter(inputs)
    flat = []
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            flat.append(next(user))
        elif spec.target in ep.state_dict:
            flat.append(ep.state_dict[spec.target])
        else:
            flat.append(ep.constants[spec.target])
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = _clone(out)
            return out

    with torch.no_grad():
        Recorder(ep.graph_module, graph=cap.graph).run(*flat)
    return values


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    return v


def call_node(node: fx.Node, tensors: list, out_placements=None, axis_sizes=None, strategy=None, coords=None):
    """node.target on its args with the tensor args (tensor_args order) replaced by `tensors`.

    With `out_placements`, shape-list args of SHAPE_ARG_OPS are localized like the
    rewriter does: entry d divided by how many pieces the output splits dim d into.
    """
    it = iter(_clone(tensors))

    def sub(a):
        if isinstance(a, fx.Node):
            return next(it)  # tensor_args keeps every Node argument these ops take
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a) if isinstance(a, tuple) else [sub(x) for x in a]
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a
    args, kwargs = sub(node.args), sub(node.kwargs)
    if out_placements is not None and op_name(node) in SHAPE_ARG_OPS:
        shp = [v if v == -1 else v // dim_factor(out_placements, d, axis_sizes) for d, v in enumerate(args[1])]
        args = (args[0], shp) + tuple(args[2:])
    target = node.target
    if strategy is not None:  # the rewriter's own choice of local op (e.g. vocab-parallel embedding)
        target, args, kwargs = local_call(node, strategy, coords, axis_sizes, args, kwargs)
    if out_placements is not None and op_name(node) in SQUEEZE_OPS:
        # as the rewriter does: squeeze only the dims that are size 1 in the whole input
        target = torch.ops.aten.squeeze.dims
        args, kwargs = (args[0], squeezed_dims(node, tuple(node.args[0].meta["val"].shape))), {}
    if op_name(node) in RANDOM_OPS:
        torch.manual_seed(1234)  # ranks draw like the global run: R outputs of random ops agree
    with torch.no_grad():
        return target(*args, **kwargs)


# ---------------------------------------------------------------- simulated ranks

class Unrealizable(Exception):
    """No program can hand the op such an input (partial sums of a bool tensor)."""


def _summands(t: torch.Tensor, n: int, gen) -> list:
    if t.dtype == torch.bool:
        raise Unrealizable("P placement on a bool tensor")
    if t.is_floating_point():
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-5, 6, t.shape, generator=gen).to(t.dtype) for _ in range(n - 1)]
    return parts + [t - sum(parts)] if parts else [t]


def local_inputs(t, placements, sizes, gen) -> dict:
    """coords -> this rank's local input (a list input, like split's output, piece by piece)."""
    if isinstance(t, (list, tuple)):
        # a list (split's pieces) has one placement for every piece; the search never
        # redistributes it, so a placement some piece cannot take is never used
        for x in t:
            if any(x.shape[d] % dim_factor(placements, d, sizes) for d in range(x.dim())):
                raise Unrealizable(f"piece of shape {tuple(x.shape)} cannot take {placements}")
        per = [local_inputs(x, placements, sizes, gen) for x in t]
        return {c: [p[c] for p in per] for c in per[0]}
    # Ranks that differ only in coords of R axes hold the same data: a P axis further in
    # is decomposed once per distinct data (the key drops R coords), not once per rank.
    pieces, made = {(): t}, {}
    for a, n in enumerate(sizes):
        nxt = {}
        for key, v in pieces.items():
            if placements[a] == P:
                data_key = tuple(c for c, p in zip(key, placements) if p != R)
                if data_key not in made:
                    made[data_key] = _summands(v, n, gen)
                parts = made[data_key]
            else:
                parts = [v] * n
            for c in range(n):
                nxt[key + (c,)] = parts[c]
        pieces = nxt
    return {c: shard_full_tensor(v, placements, c, sizes) for c, v in pieces.items()}


def reassemble(outs: dict, placements, sizes, check_replicas=True):
    """The global tensor from coords -> local output, innermost axis first (nested splits)."""
    cur = outs
    for a in reversed(range(len(sizes))):
        groups = {}
        for key, v in cur.items():
            groups.setdefault(key[:-1], []).append((key[-1], v))
        nxt = {}
        for prefix, items in groups.items():
            vals = [v for _, v in sorted(items, key=lambda kv: kv[0])]
            p = placements[a]
            if p == P:
                if vals[0].dtype == torch.bool:
                    raise AssertionError(f"output P on axis {a} but the output is bool")
                nxt[prefix] = sum(vals[1:], vals[0])
            elif p == R:
                if check_replicas:
                    for c, v in enumerate(vals[1:], 1):
                        # equal_nan: a mean over no elements (cross-entropy with every target ignored) is NaN on one device too
                        torch.testing.assert_close(v, vals[0], rtol=0, atol=0, equal_nan=True, msg=lambda m: (
                            f"output R on axis {a}, but rank coord {c} differs from coord 0: {m}"))
                nxt[prefix] = vals[0]
            else:
                nxt[prefix] = torch.cat(vals, dim=shard_dim(p))
        cur = nxt
    return cur[()]


def run_strategy(node, strategy, globals_, mesh, gen) -> dict:
    """Run the op rank by rank under `strategy`: coords -> local output(s)."""
    sizes = mesh.axis_sizes
    locs = [local_inputs(t, pl, sizes, gen) for t, pl in zip(globals_, strategy.inputs)]
    return {coords: call_node(node, [l[coords] for l in locs], strategy.output, sizes, strategy, coords)
            for coords in itertools.product(*(range(n) for n in sizes))}


def check_outputs(node, outs: dict, expected, strategy, globals_, sizes):
    """Local shapes match the output placement, and the reassembled output equals `expected`."""
    many = isinstance(expected, (list, tuple))
    expected = list(expected) if many else [expected]
    for coords, o in outs.items():
        o = list(o) if many else [o]
        if len(o) != len(expected):
            raise AssertionError(f"rank {coords}: {len(o)} outputs, expected {len(expected)}")
        for i, (x, e) in enumerate(zip(o, expected)):
            want = local_shape(tuple(e.shape), strategy.output, sizes)
            if tuple(x.shape) != want:
                raise AssertionError(
                    f"rank {coords} output {i}: local shape {tuple(x.shape)}, the output placement needs {want}")
    name = op_name(node)
    for i, e in enumerate(expected):
        per_rank = {c: (o[i] if many else o) for c, o in outs.items()}
        got = reassemble(per_rank, strategy.output, sizes, check_replicas=name not in UNINITIALIZED_OPS)
        if got.dtype != e.dtype:
            raise AssertionError(f"output {i}: dtype {got.dtype}, expected {e.dtype}")
        if name in UNINITIALIZED_OPS:
            continue
        if name == "aten.dropout.default" and node.args[1] > 0:
            # masks drawn shard by shard cannot equal the global mask: each element is 0 or x/(1-p)
            x, p = globals_[0], node.args[1]
            ok = (got == 0) | torch.isclose(got, x / (1 - p))
            if not bool(ok.all()):
                raise AssertionError(f"dropout output is neither 0 nor x/(1-p) at {(~ok).nonzero().tolist()[:5]}")
            continue
        torch.testing.assert_close(got, e, equal_nan=True, msg=lambda m: f"output {i}: {m}")


def check_node(node, cap, values, mesh, gen) -> tuple[int, list]:
    """All strategies of `node` on `mesh`: (number checked, failure messages)."""
    globals_ = [values[a.name] for a in tensor_args(node)]
    expected = call_node(node, globals_)
    failures, checked = [], 0
    try:
        strategies = op_strategies(node, cap, mesh).strategies
    except Exception as e:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else "list" for t in globals_]
        return 1, [f"{op_name(node)} ({node.name}, input shapes {shapes}) on mesh {mesh.axis_sizes}: "
                   f"op_strategies raised {type(e).__name__}: {e}"]
    for s in strategies:
        if vocab_split_axes(node, s, mesh.axis_sizes) or ring_axes(node, s, mesh.axis_sizes):
            # its local op communicates inside itself, which ranks simulated one after another cannot:
            # test_vocab_parallel and test_context_parallel run them on threaded ranks against the whole op
            continue
        try:
            outs = run_strategy(node, s, globals_, mesh, gen)
        except Unrealizable:
            continue
        except Exception as e:  # a strategy the op cannot even run is a rule bug too
            failures.append(f"{_describe(node, s, globals_, mesh)}: op failed on a rank: {type(e).__name__}: {e}")
            continue
        checked += 1
        try:
            check_outputs(node, outs, expected, s, globals_, mesh.axis_sizes)
        except AssertionError as e:
            failures.append(f"{_describe(node, s, globals_, mesh)}: {str(e).strip()}")
    return checked, failures


def _describe(node, s, globals_, mesh):
    def shp(t):
        return [tuple(x.shape) for x in t] if isinstance(t, (list, tuple)) else tuple(t.shape)
    args = ", ".join(str(a) for a in node.args[1:])
    return (f"{op_name(node)} ({node.name}, input shapes {[shp(t) for t in globals_]}, other args [{args}], "
            f"kwargs {dict(node.kwargs)}) on mesh {mesh.axis_sizes}: strategy inputs {s.inputs} -> output {s.output}")


# ---------------------------------------------------------------- the tests

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Thousands of tiny ops: intra-op threads only add overhead (10x on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_every_rule_has_a_case():
    covered = set().union(*(c.ops for c in CASES))
    assert sorted(set(RULES) - covered) == [], "rules without a property test case in tests/rule_cases.py"
    assert sorted(covered - set(RULES)) == [], "cases claim ops that have no rule"


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_simulation_round_trip(data):
    """The harness itself: reassembling the local inputs of any placement gives the tensor back."""
    mesh = data.draw(st.sampled_from(MESHES))
    t = torch.randn(data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), max_size=3)), dtype=torch.float64)
    options = [R, P] + [S(d) for d in range(t.dim())]
    placements = tuple(data.draw(st.sampled_from(options)) for _ in mesh.axis_sizes)
    if any(t.shape[d] % dim_factor(placements, d, mesh.axis_sizes) for d in range(t.dim())):
        return
    gen = torch.Generator().manual_seed(0)
    locs = local_inputs(t, placements, mesh.axis_sizes, gen)
    for c, x in locs.items():
        assert tuple(x.shape) == local_shape(tuple(t.shape), placements, mesh.axis_sizes)
    torch.testing.assert_close(reassemble(locs, placements, mesh.axis_sizes), t)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_rule_matches_unsharded(case, data):
    module, inputs = data.draw(case.program, label="program")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="summand seed"))
    cap = capture(module, inputs)
    values = record_values(cap, inputs)
    nodes = [n for n in cap.graph.nodes if n.op == "call_function" and op_name(n) in case.ops]
    missing = case.ops - {op_name(n) for n in nodes}
    assert not missing, f"case {case.name} did not emit {sorted(missing)}"
    failures = []
    for mesh in MESHES:
        for node in nodes:
            checked, fails = check_node(node, cap, values, mesh, gen)
            assert checked >= 1, f"{node.name}: no strategy checked (not even all-R)"
            failures += fails
    assert not failures, f"{len(failures)} strategies disagree with the unsharded op:\n" + "\n".join(failures[:20])
