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
    got = sp._best_bounds(spans, cuts, list(sp._span_columns(spans, cuts)), num_stages, cap)
    assert got == _scan(spans, cuts, num_stages, cap)
