"""Capture: shapes as sympy (dynamic dims named after their torch.export.Dim), dtypes, module paths, params."""
import sympy
import torch

from autopar.capture.export import INPUT, OP, PARAM, capture
from autopar.testing import GPT, GPTConfig


def test_capture_annotates_nodes():
    torch.manual_seed(0)
    batch = torch.export.Dim("batch")
    cap = capture(GPT(GPTConfig(n_layer=1)), (torch.randint(0, 64, (4, 16)),),
                  dynamic_shapes={"idx": {0: batch}})
    b = cap.symbols["batch"]
    assert cap.hints[b] == 4
    (idx,) = cap.input_names
    assert cap.info[idx].kind == INPUT and cap.info[idx].meta.shape == (b, sympy.Integer(16))
    linears = [n for n in cap.graph.nodes if cap.info[n.name].kind == OP and "linear" in n.name]
    q = next(n for n in linears if cap.info[n.name].module_path == "h.0.attn.q")
    info = cap.info[q.name]
    assert info.meta.shape == (b, 16, 32) and info.meta.hint == (4, 16, 32)
    assert info.meta.dtype == torch.float32
    assert info.params_read == ("h.0.attn.q.weight", "h.0.attn.q.bias")
    params = {i.target_name for i in cap.info.values() if i.kind == PARAM}
    assert "lm_head.weight" in params and "h.0.attn.k.weight" in params
