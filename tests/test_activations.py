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
from autopar.activations import CPU, Arg, New, op_keeps, requires_grad, storage_owners
from autopar.capture import BUFFER, PARAM, capture
from autopar.placement import R
from autopar.rules import tensor_args
from autopar.testing import GPT, MLP, GPTConfig, run_threaded

REL = 0.03


class LogitsOnly(nn.Module):
    """HF models return a ModelOutput; autopar plans the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def mlp():
    return MLP([16, 32, 16]), torch.randn(8, 16)


def gpt():  # dropout > 0: CPU keeps a noise tensor of the input's dtype per dropout
    return GPT(GPTConfig(n_layer=2, dropout=0.1)).train(), torch.randint(0, 64, (4, 16))


def llama():  # GQA: 4 query heads, 2 key/value heads (one per rank under tp=2)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, attn_implementation="sdpa")
    return LogitsOnly(transformers.LlamaForCausalLM(cfg)).train(), torch.randint(0, 64, (4, 16))


MODELS = {"mlp": mlp, "gpt": gpt, "llama": llama}
# (mesh shape, axis names, strategy); a 1-rank mesh is the unparallelized model
LAYOUTS = {"none": ((1,), ("dp",), "ddp"), "ddp": ((2,), ("dp",), "ddp"), "fsdp": ((2,), ("dp",), "fsdp"),
           "tp": ((2,), ("tp",), "tp"), "tp+sp": ((2,), ("tp",), "tp+sp")}


def _kept_bytes(rank, model, x, mesh_shape, names, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    row = autopar.audit(pm, pm.plan.local_inputs(x)).row("activations saved for backward")
    return row.predicted, row.measured


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_activations_match_what_autograd_keeps_on_every_rank(name, layout):
    torch.manual_seed(0)
    model, x = MODELS[name]()
    mesh_shape, names, strategy = LAYOUTS[layout]
    results = run_threaded(mesh_shape[0], _kept_bytes, model, x, mesh_shape, names, strategy)
    for rank, (predicted, measured) in enumerate(results):
        assert measured == pytest.approx(predicted, rel=REL), (
            f"{name} {layout} rank {rank}: predicted {predicted:.0f} B, autograd kept {measured:.0f} B")


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
        if isinstance(keep, Arg):
            if keep.index >= len(args) or R in keep.unless:
                continue
            if keep.needs is not None and not any(j < len(args) and args[j].name in grad for j in keep.needs):
                continue
            value = (args[keep.index].name, None)
        else:
            value = (node.name, keep.index)
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


@pytest.mark.parametrize("name", list(MODELS))
def test_each_op_keeps_what_the_table_says(name):
    """Op by op on CPU: the tensors autograd keeps (by storage) against op_keeps."""
    torch.manual_seed(0)
    model, x = MODELS[name]()
    cap = capture(model, (x,))
    grad, owner = requires_grad(cap), storage_owners(cap)
    ep = cap.exported
    values = {**dict(model.named_parameters()), **dict(model.named_buffers()), **ep.constants}
    inputs = [values.get(s.target, x) for s in ep.graph_signature.input_specs]
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

    PerOp(fx.GraphModule(ep.graph_module, ep.graph)).run(*inputs)
    assert not wrong, "\n".join(wrong)


def test_hardware_kernels():
    from autopar.activations import CUDA, kernel_family
    assert kernel_family(cm.get_hardware("cpu")) == CPU
    assert kernel_family(cm.get_hardware("h100")) == kernel_family(cm.get_hardware("a100")) == CUDA
