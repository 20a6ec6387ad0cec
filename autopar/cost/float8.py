"""Float8 linears: which linear layers may run their matmuls in float8, and the layouts they may take.

The rule (precision.Float8 holds its knobs). A captured `aten.linear` runs in float8 when:
- its weight is a parameter of the model (a linear of two activations has no weight to cast once);
- its weight's two dims, in_features (K) and out_features (N), are multiples of 16: PyTorch's scaled matmul on
  H100/H200 takes no other. So must their pieces be, where the plan splits the weight over ranks;
  a linear whose pieces are not stays in the compute dtype under that plan, with a warning
  (planning/result.float8_linears);
- its module path holds none of `filter_fqns` as whole path parts (torchtitan's default "output" and
  Hugging Face's "lm_head": the output head stays in the compute dtype). torchtitan matches substrings;
  parts here, so that "output" does not also catch BERT's `attention.output.dense`.

And in every layout the search may give it, the input and the weight arrive whole-valued (no partial
sums: float8's cast of a sum is not the sum of the casts; `castable`). A linear whose output gradient the
plan would leave partial for the gradient buckets stays in the compute dtype too (planning's choice, with
a warning naming it).

The rows a linear multiplies (batch x sequence on a rank) must be a multiple of 16 on a GPU as well, for
the weight gradient's matmul; that is a run-time shape and the runtime says so when it is not.
"""
from __future__ import annotations

from ..capture.export import PARAM, Captured
from ..sharding.op_spec import op_name, tensor_args
from ..sharding.placement import P, dim_factor
from .precision import Float8

FLOAT8_DIM_MULTIPLE = 16
LINEAR = "aten.linear.default"


def _path_has(path: str, fqn: str) -> bool:
    """Does the module path hold `fqn` as whole dot-separated parts ("output" in "model.output", not in
    "attn.output_proj")?"""
    parts, want = path.split("."), fqn.split(".")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def float8_candidates(cap: Captured, config: Float8) -> tuple[dict, dict]:
    """({linear node: (K, N)} of the linears the rule lets run in float8, {linear node: why not} of the
    others), in graph order. K, N: the weight's in_features and out_features."""
    eligible, refused = {}, {}
    for node in cap.graph.nodes:
        if node.op != "call_function" or op_name(node) != LINEAR:
            continue
        path = cap.info[node.name].module_path or "<root>"
        args = tensor_args(node)
        weight = cap.info.get(args[1].name) if len(args) > 1 else None
        if weight is None or weight.kind != PARAM or weight.meta is None or len(weight.meta.hint) != 2:
            refused[node.name] = f"{path}: its weight is not a parameter of the model"
            continue
        n, k = weight.meta.hint
        hit = next((f for f in config.filter_fqns if _path_has(path, f)), None)
        if hit is not None:
            refused[node.name] = f"{path}: filter_fqns holds {hit!r}"
        elif k % FLOAT8_DIM_MULTIPLE or n % FLOAT8_DIM_MULTIPLE:
            refused[node.name] = (f"{path}: weight {n}x{k}, not multiples of {FLOAT8_DIM_MULTIPLE} (the scaled matmul "
                                  "takes no other)")
        else:
            eligible[node.name] = (k, n)
    return eligible, refused


def castable(strategy) -> bool:
    """Can a float8 linear run in `strategy` (inputs: activation, weight[, bias])? Its activation and weight
    must arrive whole-valued: float8's cast of a partial sum is not the cast of the sum."""
    return P not in strategy.inputs[0] and P not in strategy.inputs[1]


def pieces_fit(strategy, k: int, n: int, axis_sizes) -> bool:
    """Are the weight's pieces under `strategy` multiples of 16 in both dims, as the scaled matmul needs?"""
    w = strategy.inputs[1]
    return all((size // dim_factor(w, d, axis_sizes)) % FLOAT8_DIM_MULTIPLE == 0 for d, size in enumerate((n, k)))


def float8_strategies(strategies: dict, float8: dict) -> dict:
    """`strategies` (all_strategies') with each float8 linear's list cut to the castable layouts. A repeated
    block's nodes share one list (all_strategies' same_as), and still do: the search ties them by it."""
    cut: dict = {}   # id of a shared list -> its cut
    out = dict(strategies)
    for name in float8:
        ns = strategies[name]
        key = id(ns.strategies)
        if key not in cut:
            cut[key] = [s for s in ns.strategies if castable(s)]
        out[name] = type(ns)(ns.node, ns.kind, cut[key], ns.replicated_fallback)
    return out
