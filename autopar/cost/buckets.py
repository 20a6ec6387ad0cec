"""Gradient buckets as the plan predicts them: which weights' data-axis reductions are bucketed, and how.

The runtime (runtime/reduction/grad_buckets.py) all-reduces the gradients of weights
replicated on a data axis in flat buckets after their last use in backward,
as DDP does; the plan's list of collectives must show those buckets, not one
all-reduce per weight, or its bytes per call and its latency terms would not
be what the module does. The prediction and the plan's schedule
(planning/schedule.py, which the runtime runs) call the functions here, so they
cannot disagree. The rewriter also asks here whether the buckets can apply
the batch mean's 1/n (bucket_grad_scale), which the outputs' gradient
otherwise gets (output_grad_scale).
"""
from __future__ import annotations

from ..capture.export import INPUT, PARAM, Captured
from ..sharding.op_spec import tensor_args
from ..sharding.placement import R, is_shard

DEFAULT_BUCKET_BYTES = 25 * 2**20   # DDP's default: big enough that per-call latency is small next to the bytes


def deferred_axes(cap: Captured, strategies: dict, grad_nodes: set) -> dict:
    """Parameter node -> the mesh axes whose gradient all-reduce the buckets do, ordered by first use.

    An axis qualifies when every use of the weight reads it whole there and gets back a partial sum (a
    data axis: the batch is split), directly or through ops that left their gradient partial too
    (`partial_gradients`): only then is the reduction there one all-reduce of the summed uses, which
    nothing in backward waits for. ZeRO weights are left to their optimizer wrapper, and weights a use
    gathers (FSDP) to the reduction of that gather.
    """
    return {n: axes for n, axes in partial_gradients(cap, strategies, grad_nodes).items()
            if cap.info[n].kind == PARAM}


def partial_gradients(cap: Captured, strategies: dict, grad_nodes: set, structure: tuple | None = None) -> dict:
    """Node -> the mesh axes on which its gradient is left a partial sum, for the buckets to reduce: the
    weights of `deferred_axes` (first, in order of first use), then the activations between such weights
    and the ops whose split makes the gradient partial.

    Such an activation is computed alike on every rank of the axis (its op reads every input whole and
    replicated there), every use hands its gradient back partial there, and every input that needs a
    gradient is such a weight or activation. GPT-2's position embedding is the case: `wpe(arange(T))`
    is added to the batch-split tokens, so its [T, C] gradient is partial over the data axes. Reducing it
    there would be one blocking all-reduce in the middle of backward; but backward is linear in the
    gradient, so its partial sum can flow on to `wpe.weight` and be reduced in the weight's bucket, with
    the other gradients, where nothing waits for it.

    `structure`: graph_uses(cap), where the caller keeps it between calls on one graph.
    """
    params = {n for n, info in cap.info.items() if info.kind == PARAM and n in grad_nodes
              and strategies.get(n) is not None and not strategies[n].zero_axes}
    uses, args = graph_uses(cap) if structure is None else structure
    sunk = {}   # candidates, then (after the loop) the activations that qualify
    for node in cap.graph.nodes:
        s = strategies.get(node.name)
        if node.op == "call_function" and node.name in grad_nodes and s is not None:
            axes = {x for x, p in enumerate(s.output) if p == R and all(q[x] == R for q in s.inputs)}
            if axes:
                sunk[node.name] = axes
    partial: dict = {}   # (id of a strategy, input index) -> its grad_partial: repeated blocks share strategies
    while True:   # drop what fails until nothing does: each pass only removes
        weights = {n: _partial_uses(uses.get(n, ()), strategies[n].output, strategies, sunk, partial) for n in params}
        changed = False
        for name in list(sunk):
            ok = sunk[name] & _partial_uses(uses.get(name, ()), strategies[name].output, strategies, sunk, partial)
            for a in args[name]:
                if a.name in grad_nodes:
                    ok &= weights.get(a.name, sunk.get(a.name, set()))
            if ok != sunk[name]:
                changed = True
                if ok:
                    sunk[name] = ok
                else:
                    del sunk[name]
        if not changed:
            break
    found: dict = {}   # weights in order of first use
    for node_args in args.values():
        for a in node_args:
            if a.name in params and a.name not in found:
                found[a.name] = weights[a.name]
    found.update(sunk)
    return {n: tuple(sorted(axes)) for n, axes in found.items() if axes}


def graph_uses(cap: Captured) -> tuple:
    """(node name -> [(consumer node, tensor input index)], output or call_function node name -> its
    tensor_args, in graph order): what partial_gradients reads of the graph, whatever the layouts."""
    uses: dict = {}
    args: dict = {}
    for node in cap.graph.nodes:
        if node.op in ("output", "call_function"):
            args[node.name] = tensor_args(node)
            for i, a in enumerate(args[node.name]):
                uses.setdefault(a.name, []).append((node, i))
    return uses, args


def _partial_uses(uses, src, strategies: dict, sunk: dict, partial: dict | None = None) -> set:
    """The axes on which every one of `uses` ((consumer, input index); the tensor's layout `src`) reads the
    tensor whole and replicated and hands its gradient back partial: the consumer splits the axis, or
    is itself in `sunk` there."""
    found = None
    for c, i in uses:
        s = strategies.get(c.name)
        ok = set()
        if s is not None and c.op == "call_function":
            dst = s.inputs[i]
            # a weight gathered for its use (FSDP storage) reduce-scatters its gradient in the graph or
            # with its layer (layer_groups.py), which then owns the gradient: its other axes stay there too
            if not any(is_shard(p) and q == R for p, q in zip(src, dst)):
                if partial is None:
                    gp = s.grad_partial(i)
                else:
                    gp = partial.get((id(s), i))
                    if gp is None:
                        gp = partial[(id(s), i)] = s.grad_partial(i)
                ok = {x for x in set(gp) | sunk.get(c.name, set()) if src[x] == R and dst[x] == R}
        found = ok if found is None else found & ok
    return found or set()


def assign_buckets(entries: list, bucket_bytes: int) -> list:
    """Buckets of `entries` [(name, numel, axes, kind, itemsize)] taken in order (backward's): one list of
    names per bucket, each bucket of one (axes, kind), closed when the next weight would take it past
    `bucket_bytes` (a weight bigger than that gets a bucket of its own). `kind`: what must match to share a
    flat buffer (the reduce dtype)."""
    buckets: list = []
    open_bucket: dict = {}   # (axes, kind) -> [index in buckets, bytes so far]
    for name, n, axes, kind, itemsize in entries:
        key = (tuple(axes), kind)
        cur = open_bucket.get(key)
        if cur is None or (cur[1] and cur[1] + n * itemsize > bucket_bytes):
            cur = open_bucket[key] = [len(buckets), 0]
            buckets.append((tuple(axes), kind, []))
        buckets[cur[0]][2].append(name)
        cur[1] += n * itemsize
    return buckets


def params_by_first_use(cap: Captured) -> list:
    """Parameter FQNs in the order forward first reads them: backward makes their gradients in reverse."""
    found: dict = {}
    for node in cap.graph.nodes:
        if node.op in ("call_function", "output"):
            for a in node.all_input_nodes:
                info = cap.info.get(a.name)
                if info is not None and info.kind == PARAM:
                    found.setdefault(info.target_name, None)
    return list(found)


def zero_buckets(order: list, param_zero: dict, sizes: dict, bucket_bytes: int, level: int, axis_sizes: dict) -> list:
    """The buckets of one ZeRO level (runtime/reduction/zero_buckets.py): [(ZeRO axis name, [FQN])] in launch order.
    Their gradients are reduce-scattered together (level 2 in backward, level 1 at the optimizer step) and
    their updated slices all-gathered together after the step.

    `order`: params_by_first_use; `param_zero`: Plan.param_zero (FQN -> (level, axis names)); `sizes`: FQN ->
    (elements of the flat local weight, bytes per element of its gradient on the network, bytes per element
    of the weight), for the weights that get a gradient; `axis_sizes`: axis name -> ranks. Weights split
    evenly over one ZeRO axis qualify (a bucket's rows are equal slices); one split over several, or padded,
    is reduced and gathered alone. A bucket's weights share both element sizes (one flat buffer each way)."""
    entries = []
    for fqn in reversed(order):
        lvl, axes = param_zero.get(fqn, (0, ()))
        if lvl == level and len(axes) == 1 and fqn in sizes and sizes[fqn][0] % axis_sizes[axes[0]] == 0:
            numel, reduce_itemsize, weight_itemsize = sizes[fqn]
            entries.append((fqn, numel, tuple(axes), (reduce_itemsize, weight_itemsize), reduce_itemsize))
    return [(axes[0], names) for axes, _, names in assign_buckets(entries, bucket_bytes)]


def bucket_grad_scale(cap: Captured, plan, grad_nodes: set, deferred: dict) -> float:
    """The outputs' gradient factor (output_grad_scale) when the gradient buckets can apply it instead, as
    they take each weight's gradient in (as DDP divides its buckets); 1.0 where the outputs keep it.

    Backward is linear in the outputs' gradient, so scaling every weight's gradient once gives the same
    gradients as scaling the outputs'. It saves a multiply of each output's gradient and its allocation,
    every step: for a language model, a tensor the size of the logits (on 2 gloo ranks, a 4 MiB one took
    ~1000 page faults, 2-10 ms, in the steps where the allocator had given its memory back). That holds
    only where every gradient a user can see is a bucketed weight's: every weight that gets a gradient is
    bucketed (none gathered by FSDP or sharded by ZeRO), no input is floating-point (an integer one cannot
    ask for a gradient), every output with a gradient has the same factor, and there is no pipeline (a
    stage's outputs are activations the next stage's gradient comes back to). `deferred`: what
    partial_gradients found for this plan (the bucketed weights among it)."""
    if plan.pipeline is not None:
        return 1.0
    out = next(n for n in cap.graph.nodes if n.op == "output")
    layouts = plan.node_strategies["output"].inputs
    scales = {output_grad_scale(layouts[i], plan.mesh.axis_sizes)
              for i, a in enumerate(tensor_args(out)) if a.name in grad_nodes}
    if len(scales) != 1 or scales == {1.0}:
        return 1.0
    for node in cap.graph.nodes:
        if node.op != "placeholder":
            continue
        info = cap.info[node.name]
        metas = info.meta if isinstance(info.meta, list) else [info.meta]
        if info.kind == INPUT and any(m is not None and m.dtype.is_floating_point for m in metas):
            return 1.0
        if info.kind == PARAM and node.name in grad_nodes and node.name not in deferred:
            return 1.0
    return scales.pop()


def output_grad_scale(placements, axis_sizes) -> float:
    """The factor on the gradient of an output laid out as `placements`.

    An output split along the batch over n ranks gives each rank a loss that
    is the mean of its own shard; the gradient reduction then sums n such
    gradients, so each is scaled by 1/n. An output whole on an axis (a loss
    the model computed itself, already reduced over the batch) is the same
    number on every rank of that axis: its gradient is already that of the
    global loss, and scaling it would make the step 1/n too small.
    """
    scale = 1.0
    for p, n in zip(placements, axis_sizes):
        if is_shard(p):
            scale /= n
    return scale
