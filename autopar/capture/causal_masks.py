"""A causal attention mask built from shapes alone, rewritten as `is_causal=True`.

Called eagerly without padding, a Hugging Face model passes no mask to scaled_dot_product_attention
and sets `is_causal=True` (transformers' masking_utils skips the mask when it can prove it causal).
Traced, it cannot skip it: the graph builds the mask from `arange`s of the sequence length and
passes it. The numbers are the same, but the kernel is not: with a mask, CUDA's SDPA cannot run flash
attention and runs a slower kernel, and every layer reads an s x s mask. At a 0.9B Llama's shape on
one H200, attention ran at 209 TFLOP/s with the mask against 534 without (docs/gpu-results.md); on an
H100 it had made autopar's step 1.06x the model's own.

So at capture, every SDPA whose mask depends on no input's values (only on input sizes, through
`sym_size`) and computes with no number but 0 and +-1 (_plain_numbers) is evaluated at two sets of small
sizes, and where it is the causal mask both times (true on and below the diagonal, top-left aligned as
`is_causal` means it), the mask is dropped and `is_causal=True` set. A mask that reads an input (a
padded batch's attention_mask) is kept as it is.
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from .._compat import operator_name, symint_expr

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SYM_SIZE = torch.ops.aten.sym_size.int
# export checks the dtype of a `.to()`'s result with one of these: it goes with the tensor it checks
ASSERT_METADATA = "aten._assert_tensor_metadata.default"
# a mask's own subgraph in HF is ~40 nodes; past this it is not a mask built from shapes
MAX_MASK_NODES = 400
# ops whose numeric operands move or compare positions (_plain_numbers); not a fill value (where,
# masked_fill: -inf is what a float mask holds) nor a length (arange: a graph with static sizes has them)
_ARITHMETIC = {"add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "lt", "le", "gt", "ge", "eq",
               "ne", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "bitwise_and", "bitwise_or",
               "bitwise_xor", "__and__", "__or__", "__xor__"}
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
    if nodes is None or not all(_plain_numbers(n) for n in nodes):
        return False
    sizes = [n for n in nodes if n.target is SYM_SIZE]
    exprs = [_size_expr(n.meta.get("val")) for n in sizes]
    lengths = [_size_expr(x.meta["val"].shape[-2]) for x in sdpa.args[:2]]
    shape = [_size_expr(d) for d in mask.meta["val"].shape]
    if None in exprs + lengths + shape:
        return False
    symbols = sorted(set().union(*(e.free_symbols for e in exprs + lengths + shape)), key=str)
    # Two sets of small sizes, each symbol its own: the mask is a function of the sizes, so being causal at
    # both (and not merely at the example's) is the evidence; small, because a 4096-long sequence's mask
    # at a batch of 64 is a GB. A size baked into the graph as a number stays that number.
    for first in (3, 6):
        trial = {sym: first + 2 * i for i, sym in enumerate(symbols)}
        at = [int(e.xreplace(trial)) for e in exprs + lengths + shape]
        values, (q_len, k_len), mask_shape = dict(zip(sizes, at)), at[len(exprs):len(exprs) + 2], at[len(exprs) + 2:]
        if math.prod(mask_shape) > MAX_MASK_ELEMENTS:
            return False   # static sizes too large to evaluate here: the mask stays
        try:
            value = _evaluate(nodes, values)
        except Exception:   # an op that cannot run at these sizes: not provably causal
            return False
        if not _causal(value, q_len, k_len):
            return False
    return True


def _plain_numbers(node: fx.Node) -> bool:
    """Whether the numbers a mask op computes with are only 0 and +-1 (a slice's bounds too, or whole).

    A mask can equal the causal one at every size tried and differ past a number in the graph: a sliding
    window of 4096 keys (Mistral, Qwen2) or a chunk of 8192 (Llama 4) is causal for any shorter sequence.
    Such a number shows up as an operand (`q_idx - 4096`) or a slice bound; a mask with one stays a mask.
    Other ops' numbers are dims (unsqueeze(x, 2)), which no size reaches past."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name == "slice":   # bounds of 0, +-1 or whole (2**63 - 1), step 1; a dim of any number
        bounds = [b for b in node.args[2:4] if isinstance(b, int) and b != _FULL_SLICE_END]
        return all(b in (-1, 0, 1) for b in bounds) and (len(node.args) < 5 or node.args[4] == 1)
    if name in _ARITHMETIC:
        numbers = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (int, float))]
        return all(a in (-1, 0, 1) for a in numbers)
    return True


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
