"""The activation model (autopar/activations.py) against what autograd really keeps.

Measured with saved-tensor hooks (autopar.audit on every rank, or directly on
the eager model), counted by storage as autograd holds it. Tiny models: the
whole file runs in seconds.
"""
import copy
import warnings

import pytest
import torch
from torch import fx, nn

import autopar
import cost_models as cm
from autopar.cost.saved_tensors import CPU, Arg, New, op_keeps
from autopar.cost.activations import kept_value, requires_grad, storage_owners
from autopar.capture.export import BUFFER, PARAM, capture
from autopar.sharding.placement import R
from autopar.sharding.op_spec import tensor_args
from autopar.testing import GPT, MLP, GPTConfig, run_threaded, tiny_llama

REL = 0.03


def mlp():
    return MLP([16, 32, 16]), torch.randn(8, 16)


def gpt():  # dropout > 0: CPU keeps a noise tensor of the input's dtype per dropout
    return GPT(GPTConfig(n_layer=2, dropout=0.1)).train(), torch.randint(0, 64, (4, 16))


def llama():  # GQA: 4 query heads, 2 key/value heads (one per rank under tp=2)
    pytest.importorskip("transformers")
    return tiny_llama(), torch.randint(0, 64, (4, 16))


MODELS = {"mlp": mlp, "gpt": gpt, "llama": llama}


class OpZoo(nn.Module):
    """One of each op op_keeps knows, on CPU: what the whole-model tests do not reach."""

    def __init__(self):
        super().__init__()
        self.lin, self.emb = nn.Linear(8, 8), nn.Embedding(10, 8)
        self.rms = nn.RMSNorm(8)

    def forward(self, x, idx, target):
        y = self.lin(x) + self.emb(idx)                         # [4, 8]
        e = nn.functional
        outs = [y.var(-1), y.std(-1), y.clamp(-1, 1), e.elu(y), e.leaky_relu(y), e.softplus(y), e.mish(y),
                e.hardswish(y), torch.log1p(y.abs()), y.pow(2), torch.maximum(y, y * 2), torch.where(y > 0, y, y * 3),
                torch.where(y > 0, y, 0.0), torch.where(y > 1, 0.0, y),
                y.masked_fill(y > 0, 0.0), y.gather(1, idx[:, None]), y.index_select(0, idx), y[idx], y.sigmoid(),
                y.tanh(), y.exp(), y.rsqrt(), y.sqrt(), 1 / y, y.sin(), y.cos(), torch.erf(y), y.square(), y.log(),
                y.relu(), e.softmax(y, -1), y @ y.t(), torch.bmm(y[None], y.t()[None]), y / y.sum(),
                self.rms(y), e.dropout(y, 0.5), e.cross_entropy(y, target)]
        q = y.view(1, 2, 2, 8)
        mask = torch.ones(2, 2, dtype=torch.bool).tril()
        outs += [e.scaled_dot_product_attention(q, q, q, attn_mask=mask),            # CPU flash, bool mask
                 e.scaled_dot_product_attention(y[None], y[None], y[None]),          # 3-d: the math fallback
                 e.scaled_dot_product_attention(q, q, q, dropout_p=0.5)]             # dropout: math too
        return sum(t.float().sum() for t in outs)


def zoo():
    return OpZoo().train(), (torch.randn(4, 8), torch.randint(0, 4, (4,)), torch.randint(0, 8, (4,)))
# (mesh shape, axis names, strategy); a 1-rank mesh is the unparallelized model
LAYOUTS = {"none": ((1,), ("dp",), "ddp"), "ddp": ((2,), ("dp",), "ddp"), "fsdp": ((2,), ("dp",), "fsdp"),
           "tp": ((2,), ("tp",), "tp"), "tp+sp": ((2,), ("tp",), "tp+sp")}


def _audit_rows(rank, model, x, mesh_shape, names, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    return {r.quantity: (r.predicted, r.measured) for r in report.rows}


# context parallelism splits a sequence: the models that have one (the MLP's batch has no other dim to split)
LAYOUTS["cp"] = ((2,), ("cp",), "cp")
CASES = [(name, layout) for name in MODELS for layout in LAYOUTS if layout != "cp" or name != "mlp"]


@pytest.mark.parametrize("name, layout", CASES)
def test_predicted_memory_and_communication_match_the_run_on_every_rank(name, layout):
    """Activations within REL of what autograd keeps; bytes communicated, parameter, gradient and
    AdamW-state bytes exactly what the collectives moved and what is allocated."""
    torch.manual_seed(0)
    model, x = MODELS[name]()
    mesh_shape, names, strategy = LAYOUTS[layout]
    results = run_threaded(mesh_shape[0], _audit_rows, model, x, mesh_shape, names, strategy)
    for rank, rows in enumerate(results):
        predicted, measured = rows["activations saved for backward"]
        assert measured == pytest.approx(predicted, rel=REL), (
            f"{name} {layout} rank {rank}: predicted {predicted:.0f} B, autograd kept {measured:.0f} B")
        for quantity in [f"comm bytes on {a}" for a in names] + ["parameters", "gradients", "optimizer state"]:
            predicted, measured = rows[quantity]
            assert measured == predicted, f"{name} {layout} rank {rank} {quantity}: {predicted} vs {measured}"


def _eager_kept_bytes(model, x) -> int:
    """Bytes of the storages autograd keeps running the plain model (parameters excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(kept.values())


# not HF Llama: traced, it builds a boolean causal mask and repeats the key/value heads;
# run eagerly it skips the mask and lets SDPA do GQA, a different (smaller) program
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_single_device_prediction_matches_the_eager_model(name):
    torch.manual_seed(0)
    model, x = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(model, (x,), {"dp": 1}, hardware="cpu")
    assert _eager_kept_bytes(model, x) == pytest.approx(plan.predicted.memory.activations, rel=REL)


def test_dropout_mask_is_the_input_dtype_on_cpu_and_bool_on_cuda():
    # CPU dropout multiplies by a noise tensor of the input's dtype; CUDA's fused kernel keeps a bool mask
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    x = torch.randn(8, 16)
    cpu, h100 = (autopar.plan(model, (x,), {"dp": 1}, hardware=hw).predicted.memory.activations
                 for hw in ("cpu", "h100"))
    mask = 8 * 32
    assert cpu - h100 == mask * (4 - 1)
    # the rest is the same on both: x kept by the first linear, the dropped-out activations by the second
    assert h100 == 8 * 16 * 4 + mask * 4 + mask * 1
    assert _eager_kept_bytes(model, x) == cpu


def _predicted_per_op(node: fx.Node, cap, grad, owner) -> int:
    """Bytes op_keeps says `node` keeps (CPU), each storage once, parameters excluded."""
    args = tensor_args(node)
    kept = {}
    for keep in op_keeps(node, cap, CPU):   # on one device: every output placement is R
        if isinstance(keep, New):
            if keep.when is None or R in keep.when:
                kept[("new", len(kept))] = _nbytes(keep.meta)
            continue
        if isinstance(keep, Arg) and R in keep.unless:
            continue
        value = kept_value(node, keep, args, grad)
        if value is None:
            continue
        root = owner.get(value, value)
        if cap.info[root[0]].kind in (PARAM, BUFFER):
            continue
        meta = cap.info[value[0]].meta
        meta = meta[value[1]] if isinstance(meta, list) and value[1] is not None else (
            meta[0] if isinstance(meta, list) else meta)
        kept[root] = _nbytes(meta)
    return sum(kept.values())


def _nbytes(meta) -> int:
    n = 1
    for s in meta.hint:
        n *= s
    return n * meta.itemsize


@pytest.mark.parametrize("name", [*MODELS, "zoo"])
def test_each_op_keeps_what_the_table_says(name):
    """Op by op on CPU: the tensors autograd keeps (by storage) against op_keeps."""
    torch.manual_seed(0)
    model, x = {**MODELS, "zoo": zoo}[name]()
    x = x if isinstance(x, tuple) else (x,)
    cap = capture(model, x)
    grad, owner = requires_grad(cap), storage_owners(cap)
    ep = cap.exported
    values = {**dict(model.named_parameters()), **dict(model.named_buffers()), **ep.constants}
    user = iter(x)
    inputs = [values[s.target] if s.target in values else next(user) for s in ep.graph_signature.input_specs]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    wrong = []

    class PerOp(fx.Interpreter):
        def run_node(self, n):
            kept = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in weights:
                    kept[s.data_ptr()] = max(kept.get(s.data_ptr(), 0), t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = super().run_node(n)
            if n.op == "call_function":
                predicted = _predicted_per_op(n, cap, grad, owner) if n.name in grad else 0
                if predicted != sum(kept.values()):
                    wrong.append(f"{n.name} ({n.target}): table {predicted} B, autograd {sum(kept.values())} B")
            return result

    PerOp(fx.GraphModule(ep.graph_module, cap.graph)).run(*inputs)   # cap.graph: renumbered names
    assert not wrong, "\n".join(wrong)


def test_hardware_kernels():
    from autopar.cost.saved_tensors import CUDA, kernel_family
    assert kernel_family(cm.get_hardware("cpu")) == CPU
    assert kernel_family(cm.get_hardware("h100")) == kernel_family(cm.get_hardware("a100")) == CUDA
