"""The stage cut's program (stage_partition._best_bounds: numpy, every stage count at once, the earliest cuts
that cannot fit left out) against a plain scan of every (cut, stage count, earlier cut): the same boundaries,
ties broken alike (least slowest stage, then least total time, then the first earlier cut)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.search import stage_partition as sp
from autopar.search.pipeline import GPIPE, INTERLEAVED, ONE_F_ONE_B
from autopar.search.stage_costs import OpCosts
from cost_models.hardware import Link


def _scan(spans, cuts: list, num_stages: int, cap) -> list | None:
    best = {(0, 0): (0.0, 0.0, 0)}   # (stages, cut index) -> (slowest, total, previous cut index)
    for j in range(1, len(cuts)):
        for s in range(1, num_stages + 1):
            if (s == num_stages) != (cuts[j] == spans.n):
                continue
            options = []
            for i in range(j):
                a, b = cuts[i], cuts[j]
                if (s - 1, i) not in best or not any(a <= r < b for r in spans.reads):
                    continue
                if cap is not None and spans.memory(a, b, s - 1) > cap:
                    continue
                slowest, total, _ = best[s - 1, i]
                t = spans.time(a, b)
                options.append((max(slowest, t), total + t, i))
            if options:
                best[s, j] = min(options)
    if (num_stages, len(cuts) - 1) not in best:
        return None
    bounds, k = [cuts[-1]], len(cuts) - 1
    for s in range(num_stages, 0, -1):
        k = best[s, k][2]
        bounds.append(cuts[k])
    return bounds[::-1]


@st.composite
def _cut_problems(draw):
    n = draw(st.integers(2, 14))
    small = st.integers(0, 3).map(float)   # small whole numbers: ties everywhere
    weights = draw(st.lists(st.tuples(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True),
                                      small), max_size=4))
    users = {f"w{k}": sorted(readers) for k, (readers, _) in enumerate(weights)}
    state = {f"w{k}": (size, 0.0, 0.0, 0.0, 0.0) for k, (_, size) in enumerate(weights)}
    acts = st.integers(-1, 3).map(float)   # an op may keep less than its inputs did (terms.regather_saving)
    costs = OpCosts([f"op{k}" for k in range(n)], draw(st.lists(small, min_size=n, max_size=n)),
                    draw(st.lists(acts, min_size=n, max_size=n)), users,
                    draw(st.lists(small, min_size=n + 1, max_size=n + 1)), [], state, [({}, {})] * n)
    schedule = draw(st.sampled_from([GPIPE, ONE_F_ONE_B, INTERLEAVED]))
    v = draw(st.integers(2, 3)) if schedule == INTERLEAVED else 1
    num_stages = draw(st.integers(1, 2)) * v
    cuts = [0] + draw(st.lists(st.integers(1, n - 1), unique=True).map(sorted)) + [n]
    spans = sp._Spans.of(costs, Link(bandwidth=1.0, latency=1.0), schedule, num_stages,
                         draw(st.integers(1, 6)), draw(small), v)
    cap = draw(st.none() | st.integers(0, 40).map(float))
    return spans, cuts, num_stages, cap


@settings(max_examples=300)
@given(_cut_problems())
def test_program_matches_a_plain_scan(problem):
    spans, cuts, num_stages, cap = problem
    got, _ = sp._best_bounds(spans, cuts, sp._span_table(spans, cuts), num_stages, cap)
    assert got == _scan(spans, cuts, num_stages, cap)


@st.composite
def _timed_problems(draw):
    """Cut problems of uneven float times (a few ops far slower: the program's first bounds on a stage's time
    fail and it widens them) and many cut points, stages and caps."""
    n = draw(st.integers(4, 24))
    times = draw(st.lists(st.one_of(st.floats(0.0, 2.0), st.floats(5.0, 60.0)), min_size=n, max_size=n))
    weights = draw(st.lists(st.tuples(st.lists(st.integers(0, n - 1), min_size=1, max_size=4, unique=True),
                                      st.floats(0.0, 5.0)), min_size=1, max_size=6))
    users = {f"w{k}": sorted(readers) for k, (readers, _) in enumerate(weights)}
    state = {f"w{k}": (size, 0.0, 0.0, 0.0, 0.0) for k, (_, size) in enumerate(weights)}
    acts = draw(st.lists(st.floats(-1.0, 4.0), min_size=n, max_size=n))
    crossing = draw(st.lists(st.floats(0.0, 3.0), min_size=n + 1, max_size=n + 1))
    costs = OpCosts([f"op{k}" for k in range(n)], times, acts, users, crossing, [], state, [({}, {})] * n)
    schedule = draw(st.sampled_from([GPIPE, ONE_F_ONE_B, INTERLEAVED]))
    v = draw(st.integers(2, 3)) if schedule == INTERLEAVED else 1
    num_stages = draw(st.integers(1, 3)) * v
    cuts = [0] + draw(st.lists(st.integers(1, n - 1), unique=True).map(sorted)) + [n]
    spans = sp._Spans.of(costs, Link(bandwidth=4.0, latency=0.25), schedule, num_stages,
                         draw(st.integers(1, 8)), draw(st.floats(0.0, 3.0)), v)
    cap = draw(st.none() | st.floats(0.0, 80.0))
    return spans, cuts, num_stages, cap


@settings(max_examples=400)
@given(_timed_problems(), st.floats(0.0, 200.0))
def test_bounded_program_matches_a_plain_scan(problem, lower):
    """Whatever bound on a stage's time the program starts from (`lower`: a looser cap's slowest stage, or any
    guess), it finds the plain scan's cut: a bound changes only how many stages it looks at."""
    spans, cuts, num_stages, cap = problem
    got, slowest = sp._best_bounds(spans, cuts, sp._span_table(spans, cuts), num_stages, cap, lower)
    want = _scan(spans, cuts, num_stages, cap)
    assert got == want
    if want is not None:
        assert slowest == max(spans.time(a, b) for a, b in zip(want, want[1:]))


@settings(max_examples=200)
@given(_timed_problems(), st.data())
def test_device_memory_matches_the_plain_sums(problem, data):
    """stage_costs' device memory (the weights a device reads found with numpy over its runs of ops; the
    interleaved schedule's peak over the counts in flight no other count exceeds) is the plain sums' to the bit:
    every weight each device reads, once, summed in the order of `users`; the activations' peak over every
    count the schedule goes through."""
    from autopar.search.pipeline import PipelinePlan, Stage, device_activations
    from autopar.search.stage_costs import _device_activations, _device_state, device_state
    spans, cuts, _, _ = problem
    costs, v = spans.costs, spans.stages_per_device
    p = data.draw(st.integers(1, 3))
    num_stages = p * v
    if len(cuts) - 1 < num_stages:
        return
    bounds = [0] + sorted(data.draw(st.lists(st.sampled_from(cuts[1:-1]), min_size=num_stages - 1,
                                            max_size=num_stages - 1, unique=True))) + [spans.n] \
        if num_stages > 1 else [0, spans.n]
    acts = data.draw(st.lists(st.floats(-2.0, 1e12), min_size=num_stages, max_size=num_stages))
    stages = tuple(Stage(s, tuple(costs.order[i:j]), "", 0.0, 0.0, acts[s], 1, 0.0)
                   for s, (i, j) in enumerate(zip(bounds, bounds[1:])))
    pipe = PipelinePlan("pp", num_stages, spans.microbatches, spans.schedule, stages, 0.0, 0.0, v)
    pos = costs.position
    for c in range(p):
        idx = [pos[x] for s in pipe.stages_on(c) for x in pipe.stages[s].nodes]
        assert _device_state(costs, pipe, c) == device_state(costs, idx)
        assert _device_activations(pipe, c) == device_activations(pipe, c)
