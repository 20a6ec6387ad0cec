"""A causal attention mask built from shapes alone, rewritten as `is_causal=True`.

Called eagerly without padding, a Hugging Face model passes no mask to scaled_dot_product_attention
and sets `is_causal=True` (transformers' masking_utils skips the mask when it can prove it causal).
Traced, it cannot skip it: the graph builds the mask from `arange`s of the sequence length and
passes it. The numbers are the same, but the kernel is not: with a mask, CUDA's SDPA cannot run flash
attention and runs a slower kernel, and every layer reads an s x s mask. At a 0.9B Llama's shape on
one H200, attention ran at 209 TFLOP/s with the mask against 534 without (docs/gpu-results.md); on an
H100 it had made autopar's step 1.06x the model's own.

So at capture, an SDPA's mask is dropped and `is_causal=True` set only where the mask is the causal one
(true on and below the diagonal, top-left aligned as `is_causal` means it) at every length the module can
be called with. The evidence (`_is_causal_from_shapes`):
- the mask depends on no input's values, only on input sizes (through `sym_size`): a padded batch's
  attention_mask reads an input and is kept;
- where the sequence length is dynamic, no number in the mask's subgraph can move or compare positions
  except 0 and +-1 (`_position_numbers`): a sliding window of 4096 keys, a chunk of 8192, a `triu(-7)`,
  `i >> 3`, a prefix of `n // 4`, a window read from `torch.full((), 8)`, a table of a static size
  `ones(64, 64)[:n, :n]` each shows up as such a number. Numbers at a dim (unsqueeze's, a slice's) and a
  masking fill (-inf, a dtype's min) move nothing;
- the mask, evaluated on CPU, is causal at two small sets of sizes, at the example's sizes and past them
  (twice the example's length and one), each symbol its own value; the last two where the mask is small
  enough to build here (a 4096-long example's is, 8193 long is not). With the numbers above ruled out,
  a mask causal at all of these is taken as causal at every length: what makes a mask of sizes differ
  past some length is a number, and those are the ones refused;
- where the length is static, export allows only that length, and the mask is evaluated at it.
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from .._compat import operator_name, symint_expr, symint_hint

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SYM_SIZE = torch.ops.aten.sym_size.int
# export checks the dtype of a `.to()`'s result with one of these: it goes with the tensor it checks
ASSERT_METADATA = "aten._assert_tensor_metadata.default"
# a mask's own subgraph in HF is ~40 nodes; past this it is not a mask built from shapes
MAX_MASK_NODES = 400
# ops whose numeric operands move or compare positions (_plain_numbers); not a fill value (where,
# masked_fill: -inf is what a float mask holds) nor a length (arange: a graph with static sizes has them)
# where an op's literal numbers name dims, not positions: (positional indices, keyword names)
_DIM_ARGS = {"unsqueeze": ((1,), ()), "squeeze": ((1,), ("dim",)), "slice": ((1,), ("dim",)),
             "select": ((1,), ("dim",)), "sym_size": ((1,), ("dim",)), "cumsum": ((1,), ("dim",)),
             "diff": ((2,), ("dim",)), "transpose": ((1, 2), ("dim0", "dim1")), "permute": ((1,), ("dims",)),
             "flip": ((1,), ("dims",)), "sum": ((1,), ("dim",)), "any": ((1,), ("dim",)), "all": ((1,), ("dim",)),
             "amax": ((1,), ("dim",)), "amin": ((1,), ("dim",)), "movedim": ((1, 2), ("source", "destination"))}
# where a literal number is what a masked position holds (-inf, a dtype's min), not a position
_FILL_ARGS = {"where": (1, 2), "masked_fill": (2,), "full": (1,), "new_full": (2,), "fill": (1,),
              "scalar_tensor": (0,), "full_like": (1,)}
# a fill is -inf or at most float16's min (-65504): no position is that far below zero
_FILL_AT_MOST = -65504.0
_FULL_SLICE_END = 2**63 - 1
# the largest mask evaluated (a graph traced with static sizes evaluates at those): 16 MB as bool
MAX_MASK_ELEMENTS = 2**24


def rewrite_causal_masks(graph: fx.Graph) -> int:
    """Rewrite every SDPA whose mask is causal and built from shapes alone; the number rewritten."""
    verdicts, rewritten = {}, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        already_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or already_causal:
            continue
        if mask not in verdicts:
            verdicts[mask] = _is_causal_from_shapes(mask, node)
        if verdicts[mask]:
            dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
            node.args = (*node.args[:3], None, dropout, True)
            node.kwargs = kwargs
            rewritten += 1
    if rewritten:
        _erase_unused(verdicts)
    return rewritten


def _ancestors(node: fx.Node) -> list | None:
    """The nodes `node` is computed from, in graph order; None if it reads an input's values."""
    seen, stack = {}, [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function" or len(seen) > MAX_MASK_NODES:
            return None   # a placeholder read for its values, a get_attr, a call_module
        seen[n] = None
        if n.target is SYM_SIZE:
            continue   # reads only a size of its input
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_causal_from_shapes(mask: fx.Node, sdpa: fx.Node) -> bool:
    nodes = _ancestors(mask)
    if nodes is None:
        return False
    sizes = [n for n in nodes if n.target is SYM_SIZE]
    exprs = [_size_expr(n.meta.get("val")) for n in sizes]
    lengths = [_size_expr(x.meta["val"].shape[-2]) for x in sdpa.args[:2]]
    shape = [_size_expr(d) for d in mask.meta["val"].shape]
    if None in exprs + lengths + shape:
        return False
    static_length = all(e.is_number for e in lengths)
    # with a static length the module is only ever called at it, and the mask is evaluated there, unless a
    # dynamic size (a batch, another input's length) enters the mask's values; with a dynamic length, or such
    # a size, a number that moves positions (a window, a chunk) can make it causal here and not there
    values_fixed = static_length and all(_only_a_shape(n) for n, e in zip(sizes, exprs) if not e.is_number)
    if not values_fixed and any(not _position_numbers_plain(n) for n in nodes):
        return False
    symbols = sorted(set().union(*(e.free_symbols for e in exprs + lengths + shape)), key=str)
    for k, trial in enumerate(_trial_sizes(symbols, _example_sizes(nodes, sdpa, mask), lengths)):
        at = [int(e.xreplace(trial)) for e in exprs + lengths + shape]
        values, (q_len, k_len), mask_shape = dict(zip(sizes, at)), at[len(exprs):len(exprs) + 2], at[len(exprs) + 2:]
        if math.prod(mask_shape) > MAX_MASK_ELEMENTS:
            if k < 2 or static_length:
                return False   # too large to evaluate here: the mask stays
            continue   # the example's length or past it, too large to build here (8192 x 8192): the small ones and
            #            the numbers rule stand for it
        try:
            value = _evaluate(nodes, values)
        except Exception:   # an op that cannot run at these sizes: not provably causal
            return False
        if not _causal(value, q_len, k_len):
            return False
    return True


# ops whose size list (args[1]) a dynamic size may enter without changing any value, only the shape
_SHAPE_OPS = {"expand", "view", "reshape", "_unsafe_view", "new_ones", "new_zeros", "ones", "zeros"}


def _only_a_shape(size: fx.Node) -> bool:
    """Whether a sym_size read goes only into the shape of a tensor (HF expands its mask to the batch), not
    into a value a mask compares (`k < n - 8` for another input's length n)."""
    def shaped_by(user):
        name = operator_name(user.target) or ""
        op = name.split(".")[1] if name.startswith("aten.") else ""
        sizes_arg = user.args[1] if op in ("new_ones", "new_zeros", "expand", "view", "reshape", "_unsafe_view") \
            else user.args[0] if op in ("ones", "zeros") and user.args else None
        return (op in _SHAPE_OPS and isinstance(sizes_arg, (list, tuple)) and size in sizes_arg
                and not any(a is size for a in user.args if a is not sizes_arg))
    return all(shaped_by(u) for u in size.users)


def _trial_sizes(symbols: list, example: dict, lengths: list) -> list[dict]:
    """The sizes a mask is evaluated at (the first two always; the others where the mask fits in
    MAX_MASK_ELEMENTS): two small sets (3 and 6, each symbol 2 apart from the last, so no
    two are equal by chance), the example's, and past the example's (the lengths' symbols at twice theirs
    and one; the others, a batch, small, to keep the mask small)."""
    length_symbols = set().union(*(e.free_symbols for e in lengths))
    trials = [{sym: first + 2 * i for i, sym in enumerate(symbols)} for first in (3, 6)]
    if all(sym in example for sym in symbols):
        trials.append({sym: example[sym] for sym in symbols})
        trials.append({sym: 2 * example[sym] + 1 if sym in length_symbols else 2 + i for i, sym in enumerate(symbols)})
    return trials


def _example_sizes(nodes: list, sdpa: fx.Node, mask: fx.Node) -> dict:
    """Each size symbol's example value, read from the SymInts the graph was traced with."""
    found = {}
    vals = [n.meta.get("val") for n in nodes if n.target is SYM_SIZE]
    vals += [d for x in (*sdpa.args[:2], mask) for d in x.meta["val"].shape]
    for v in vals:
        if isinstance(v, torch.SymInt) and isinstance(symint_expr(v), sympy.Symbol):
            try:
                found[symint_expr(v)] = symint_hint(v)
            except TypeError:   # an unbacked size has no example value: only the small trials run
                pass
    return found


def _position_numbers_plain(node: fx.Node) -> bool:
    """Whether every number a mask op computes with is 0 or +-1, besides the dims it names and a masking fill.

    A mask can equal the causal one at every size tried and differ past a number in the graph: a sliding
    window of 4096 keys (Mistral, Qwen2) or a chunk of 8192 (Llama 4) is causal for any shorter sequence.
    Such a number is an operand (`q_idx - 4096`, `i >> 3`, `n // 4`), a diagonal (`triu(-7)`), a value
    (`full((), 8)`), a slice's bound or a size (`ones(64, 64)`); a mask with one stays a mask. A SymInt's
    arithmetic (`operator.floordiv`) is an fx node of its own and is held to the same rule."""
    name = operator_name(node.target)
    op = name.split(".")[1] if name and name.startswith("aten.") else getattr(node.target, "__name__", str(node.target))
    if op == "slice":   # bounds of 0, +-1 or whole (2**63 - 1), step 1
        bounds = [b for b in node.args[2:4] if isinstance(b, int) and b != _FULL_SLICE_END]
        return all(b in (-1, 0, 1) for b in bounds) and (len(node.args) < 5 or node.args[4] == 1)
    dim_positions, dim_keywords = _DIM_ARGS.get(op, ((), ()))
    fills = _FILL_ARGS.get(op, ())
    numbers = []
    for i, a in enumerate(node.args):
        if i in dim_positions:
            continue
        numbers += [(x, i in fills) for x in _literals(a)]
    for k, a in node.kwargs.items():
        if k in dim_keywords:
            continue
        numbers += [(x, k in ("value", "fill_value", "other") and op in _FILL_ARGS) for x in _literals(a)]
    return all(x in (-1, 0, 1) or (is_fill and x <= _FILL_AT_MOST) for x, is_fill in numbers)


def _literals(arg) -> list:
    """The numbers written into an argument (bools are 0 and 1), looking inside lists and tuples."""
    if isinstance(arg, (list, tuple)):
        return [x for a in arg for x in _literals(a)]
    return [arg] if isinstance(arg, (int, float)) else []


def _size_expr(size):
    """A size as a sympy expression (a number baked into the graph, or export's symbolic dim)."""
    if isinstance(size, int):
        return sympy.Integer(size)
    try:
        return symint_expr(size)
    except AttributeError:   # not a size
        return None


def _evaluate(nodes: list, values: dict) -> torch.Tensor:
    """Run the mask's subgraph on real CPU tensors, the sizes given by `values`."""
    env = dict(values)
    for n in nodes:
        if n in env:
            continue
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        if "device" in kwargs:   # captured on meta or a GPU: the mask's values are wanted here
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[n] = n.target(*args, **kwargs)
    return env[nodes[-1]]


def _causal(mask, q_len: int, k_len: int) -> bool:
    """Whether `mask` lets query i see key j exactly when j <= i, for every leading index."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, k_len):
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        if not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return False   # a bias, not a mask
        allowed = mask == 0
    else:
        return False
    want = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    return bool((allowed == want).all())


def _erase_unused(verdicts: dict) -> None:
    """Erase the rewritten masks' subgraphs where nothing else reads them."""
    for mask, causal in verdicts.items():
        if not causal:
            continue
        for n in reversed(_ancestors(mask) or []):
            for user in [u for u in n.users if operator_name(u.target) == ASSERT_METADATA and not u.users]:
                n.graph.erase_node(user)
            if not n.users:
                n.graph.erase_node(n)
