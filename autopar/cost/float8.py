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

The price (float8_linear_seconds; cost/terms.node_compute_time and op_collectives apply it to each float8
linear in the layout priced). Per step, a float8 linear runs:
- its three matmuls (forward, and backward's two: cost_models.TRAIN_FLOPS_FACTOR x forward's FLOPs) at the
  hardware's float8 peak (peak_flops["float8"]) times the share of the peak a step's matmuls reach
  (matmul_efficiency, measured in bf16: no float8 measurement is at hand);
- its casts, memory-bound: forward casts the activation and the weight (read each in the compute dtype,
  write 1 byte), backward casts the output's gradient and casts the activation and the weight again with
  forward's scales (runtime/lowering/float8.py: it keeps them in the compute dtype, as torchao does): 2, 2
  and 1 casts of the three tensors' local pieces; and one read of each to find its amax. Priced as one fused
  kernel each (what torch.compile makes of a cast, and torchao's kernels): run eagerly, a cast is four
  elementwise kernels through float32, and the backward matmuls' operands are transposed copies, which
  this leaves out;
- one all-reduce (MAX) of each amax, a scalar in the tensor's dtype, over each mesh axis its tensor is split
  on: the activation's and the weight's (as the op reads it) in forward, the output gradient's in backward
  (amax_collectives).
The rowwise recipe scales along other dims in backward, so its gradient is cast twice and each cast reads its
tensor for its own amaxes; its all-reduces are rows or columns of amaxes, one per axis splitting the dim each
runs along, up to six (CASTS, cast_bytes, amax_collectives).
What it keeps for backward does not change (the activation and weight in the compute dtype). An FSDP weight
is gathered in the compute dtype, as the runtime gathers it (it casts after the gather), unless
Float8.enable_fsdp_float8_all_gather: then a tensorwise linear's weight that only it reads, gathered with its
layer and handed to it as gathered (float8_gathered_params, gathers_in_float8), is cast on each rank before
the gather and moves 1 byte an element (cost/terms.edge_collectives: Problem.gather_itemsize), its layer's
amaxes are all-reduced once per forward gather (float8_gather_amaxes), and the op reduces no weight amax.

auto-fp8 (Float8.auto_filter_small_kn) keeps a linear in float8 only where this price is below the same
matmuls' in the compute dtype (float8_pays): the casts grow with the tensors, the saving with the FLOPs, so
small K and N (few FLOPs per element cast) lose.
"""
from __future__ import annotations

import cost_models as cm

from ..capture.export import PARAM, Captured
from ..errors import PlanError
from ..sharding.op_spec import op_name, tensor_args
from ..sharding.placement import P, dim_factor, is_shard, numel, shard_dim
from ..sharding.redistribute import ALL_REDUCE, Collective
from .layer_groups import gathers_float8
from .precision import Float8

FLOAT8_DIM_MULTIPLE = 16
LINEAR = "aten.linear.default"
FLOAT8_ITEMSIZE = 1
# casts per step of the activation, the weight and the output's gradient, by recipe (module docstring): tensorwise
# casts the gradient once for both backward matmuls; rowwise scales it along another dim for each
CASTS = {"tensorwise": (2, 2, 1), "rowwise": (2, 2, 2)}
# a float8 linear's amax all-reduces, in a Collective's `tensor`: the linear's name and this, per tensor
AMAX_OF = (":amax of input", ":amax of weight", ":amax of output gradient")


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


def runs_float8(strategy, weight_hint, axis_sizes) -> bool:
    """Does a float8 linear (weight of shape `weight_hint`, (N, K)) run in float8 in `strategy`? Where its
    pieces are not multiples of 16 the plan runs it in the compute dtype (planning/result.float8_linears),
    and it is priced so."""
    n, k = weight_hint
    return castable(strategy) and pieces_fit(strategy, k, n, axis_sizes)


def float8_peak(hw) -> float:
    """FLOP/s of float8 matmuls on `hw`; PlanError where its peak_flops gives none (no float8 tensor cores)."""
    peaks = dict(hw.peak_flops)
    if cm.FLOAT8 not in peaks:
        raise PlanError(f"float8 matmuls asked (precision 'fp8-mixed', 'auto-fp8' or Precision(float8=...)) on "
                        f"hardware {hw.name!r}, which gives no float8 peak (its peak_flops: {', '.join(peaks)}): a "
                        f"device without float8 tensor cores (an A100 has none) cannot run them. Plan with "
                        f"precision='bf16-mixed'; or, for a device that has them, give peak_flops['{cm.FLOAT8}'] "
                        f"(FLOP/s) in a custom cost_models.Hardware or hardware JSON spec")
    return peaks[cm.FLOAT8]


def matmul_seconds(flops, dtype: str, hw):
    """Seconds of a linear's three matmuls in `dtype` (a forward of `flops`): what cost/terms.node_compute_time
    prices every matmul at."""
    return cm.compute_time(cm.TRAIN_FLOPS_FACTOR * flops, dtype, hw) / hw.matmul_efficiency


def cast_bytes(pieces, recipe: str = "tensorwise") -> object:
    """Bytes a float8 linear's casts and amaxes move per step. `pieces`: ((elements, itemsize) of the
    activation, the weight and the output's gradient on this rank). Each cast reads the tensor and writes
    its float8 copy; tensorwise reads each for its amax once, rowwise once per cast (its scales run along
    another dim in backward: module docstring)."""
    return sum(elements * (casts * (itemsize + FLOAT8_ITEMSIZE) + (casts if recipe == "rowwise" else 1) * itemsize)
               for (elements, itemsize), casts in zip(pieces, CASTS[recipe]))


def float8_linear_seconds(flops, pieces, hw, recipe: str = "tensorwise"):
    """Seconds of a float8 linear's step on one rank: its three matmuls (a forward of `flops`) at the float8
    peak, and its casts (`pieces`: cast_bytes') at the memory bandwidth a step's small kernels reach."""
    return cm.TRAIN_FLOPS_FACTOR * flops / (float8_peak(hw) * hw.matmul_efficiency) \
        + cm.memory_time(cast_bytes(pieces, recipe), hw)


def float8_pays(tokens: int, k: int, n: int, itemsize: int, dtype: str, hw) -> bool:
    """Is a linear of weight (N, K) over `tokens` rows faster in float8 (casts included) than in `dtype`
    on `hw`? The rule auto-fp8 keeps a linear in float8 by (planning/planner.float8_linears)."""
    flops = 2 * tokens * k * n
    pieces = ((tokens * k, itemsize), (k * n, itemsize), (tokens * n, itemsize))
    return float8_linear_seconds(flops, pieces, hw) < matmul_seconds(flops, dtype, hw)


def amax_collectives(node, strategy, metas, out_meta, recipe: str = "tensorwise", shapes=()) -> list:
    """A float8 linear's amax all-reduces in `strategy`, as the runtime launches and logs them. `metas`: the
    activation's and the weight's TensorMeta; `shapes` (rowwise): the activation's, the weight's and the
    output's local shapes.

    Tensorwise: one per mesh axis its tensor is split on (S(d)), a scalar of the tensor's dtype (2 bytes in
    bf16): the activation's, then the weight's (as the op reads it, strategy.inputs[1]) in forward, the
    output gradient's in backward. Rowwise: one per axis that splits the dim a scale runs along, a row (or
    column) of amaxes: in forward the activation's per row and the weight's per output row (both along K);
    in backward the gradient's per row (along N), the weight's per column (along N), then the gradient's and
    the activation's per column (along the rows M)."""
    if recipe == "tensorwise":
        out = []
        for (meta, placements, phase), what in zip(((metas[0], strategy.inputs[0], "forward"),
                                                    (metas[1], strategy.inputs[1], "forward"),
                                                    (out_meta, strategy.output, "backward")), AMAX_OF):
            out += [Collective(ALL_REDUCE, a, meta.itemsize, phase, node.name, node.name + what)
                    for a, p in enumerate(placements) if is_shard(p)]
        return out
    x, w, g = zip((metas[0], metas[1], out_meta), (strategy.inputs[0], strategy.inputs[1], strategy.output), shapes)

    def rows(t):   # a tensor's elements but its last dim's: one amax per row
        return numel(t[2][:-1])

    def split_on(t, last: bool):   # axes splitting the tensor's last dim (last), or any other
        nd = len(t[2])
        return [a for a, p in enumerate(t[1]) if is_shard(p) and (shard_dim(p) == nd - 1) == last]
    # (tensor, axes its scales are reduced over, amaxes in the reduced tensor, phase), in the runtime's order
    reductions = ((x, split_on(x, True), rows(x), "forward", AMAX_OF[0]),
                  (w, split_on(w, True), w[2][0], "forward", AMAX_OF[1]),
                  (g, split_on(g, True), rows(g), "backward", AMAX_OF[2]),
                  (w, split_on(w, False), w[2][1], "backward", AMAX_OF[1]),
                  (g, split_on(g, False), g[2][-1], "backward", AMAX_OF[2]),
                  (x, split_on(x, False), x[2][-1], "backward", AMAX_OF[0]))
    return [Collective(ALL_REDUCE, a, count * t[0].itemsize, phase, node.name, node.name + what)
            for t, axes, count, phase, what in reductions for a in axes]

# a layer's weight amaxes, all-reduced together in float32 (runtime/reduction/layer_groups.py)
AMAX_GATHER_ITEMSIZE = 4


def float8_gathered_params(cap: Captured, linears, config: Float8 | None) -> frozenset:
    """The parameter nodes whose FSDP all-gathers move float8 where the plan gathers them with their layer
    (gathers_in_float8): with enable_fsdp_float8_all_gather, the weight of each tensorwise float8 linear of
    `linears` that no other op reads (the gathered float8 bits serve that linear only; torchao's rowwise
    recipe has no float8 all-gather either: its scales run along a dim a gather would split)."""
    if config is None or not config.enable_fsdp_float8_all_gather or config.recipe_name != "tensorwise":
        return frozenset()
    out = set()
    for name in linears:
        weight = tensor_args(cap.node(name))[1]
        if cap.info[weight.name].kind == PARAM and len(weight.users) == 1:
            out.add(weight.name)
    return frozenset(out)


def gathers_in_float8(steps: list, weight_hint, dst, axis_sizes) -> bool:
    """Does the layout change `steps` of a float8-gathered weight (float8_gathered_params) to `dst`, its
    linear's layout of it, gather it in float8? Where it joins its layer's group as is, and the linear runs in
    float8 in `dst` (its pieces multiples of 16)."""
    n, k = weight_hint
    return gathers_float8(steps) and all((size // dim_factor(dst, d, axis_sizes)) % FLOAT8_DIM_MULTIPLE == 0
                                         for d, size in enumerate((n, k)))


def float8_gather_amaxes(colls: list, members: dict, float8_axes: dict) -> list:
    """`colls` (the prediction's, its FSDP layer groups made: layer_groups.grouped) as the runtime launches them
    where layers gather float8 weights. `members`: parameter node -> layer group key; `float8_axes`: {parameter
    node gathered in float8: (its linear, the mesh axes its whole amax is reduced over)}. The linears reduce no
    weight amax; each group with float8 members all-reduces their amaxes (float32) once per forward, on each
    axis any of them needs."""
    if not float8_axes:
        return colls
    linears = {linear + AMAX_OF[1] for linear, _ in float8_axes.values()}
    out = [c for c in colls if c.tensor not in linears]
    by_group: dict = {}
    for param, (_, axes) in float8_axes.items():
        by_group.setdefault(members[param], []).append((param, axes))
    for key, entries in by_group.items():
        names = ",".join(p for p, _ in entries)
        for axis in sorted(set().union(*(set(a) for _, a in entries))):
            out.append(Collective(ALL_REDUCE, axis, AMAX_GATHER_ITEMSIZE * len(entries), "forward",
                                  f"layer {key[0] or 'root'}", names + ":amaxes"))
    return out


def shared_input_scales(cap: Captured, linears, strategies: dict) -> dict:
    """{float8 linear: the first float8 linear (graph order) reading the same activation in the same layout}, for
    each linear after the first of such a set: its forward scale of the activation (its amax, all-reduced over
    the axes splitting it) is the first one's (runtime: the rewriter makes one scale per set), so only the first
    launches those all-reduces. `strategies`: node -> the plan's chosen strategy."""
    first: dict = {}
    out = {}
    for name in linears:   # (graph order)
        key = (tensor_args(cap.node(name))[0].name, tuple(strategies[name].inputs[0]))
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def shared_scale_amaxes(colls: list, shared) -> list:
    """`colls` without the forward (and recomputed) activation amax all-reduces of the linears that reuse an
    earlier linear's scale (`shared`: shared_input_scales' keys)."""
    dropped = {name + AMAX_OF[0] for name in shared}
    return [c for c in colls if not (c.tensor in dropped and c.phase in ("forward", "recompute"))]
