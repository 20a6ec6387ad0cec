"""A Hugging Face checkpoint (`save_pretrained`, safetensors) loaded into a Llama built on the meta
device and parallelized fsdp+tp on 2 x 2 ranks computes the logits the single-device model computes.

`autopar.checkpoint.load_hf(pm, path)` after `pm.to_empty(device="cpu")` fills the shards, each rank
reading only its slices (recorded here at safetensors' read calls), from one `model.safetensors` or
from the shards an index lists; a tied embedding (stored once) loads; the rotary `inv_freq`, which no
checkpoint holds, is recomputed; a missing tensor, a wrong shape or a name without the wrapper's
prefix raise PlanError, and a wrapper loads with key_map.
"""
from __future__ import annotations

import glob
import os

import pytest
import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import autopar
from autopar.testing import run_threaded

pytestmark = pytest.mark.filterwarnings("ignore::autopar.UnsupportedOpWarning")

IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                       attn_implementation="sdpa", tie_word_embeddings=tied)


def _saved(root, tied: bool, **save_kwargs) -> tuple:
    """A random Llama saved as HF saves one: (its directory, the single-device logits on IDS, the model)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tied))
    path = str(root / ("tied" if tied else "untied") / ("sharded" if save_kwargs else "single"))
    model.save_pretrained(path, **save_kwargs)
    with torch.no_grad():
        return path, model(input_ids=IDS).logits, model


def _parallelize(model):
    return autopar.parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), (IDS,),
                               strategy="fsdp+tp", hardware="cpu")


class _RecordReads:
    """safetensors.safe_open, recording (rank, directory, tensor name, elements) of every tensor data read."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, filename, *args, **kwargs):
        return _RecordedFile(self.real(filename, *args, **kwargs), os.path.dirname(os.fspath(filename)), self.reads)


class _RecordedFile:
    def __init__(self, f, name, reads):
        self.f, self.name, self.reads = f, name, reads

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_tensor(self, key):
        t = self.f.get_tensor(key)
        self.reads.append((dist.get_rank(), self.name, key, t.numel()))
        return t

    def get_slice(self, key):
        return _RecordedSlice(self.f.get_slice(key), self, key)

    def __getattr__(self, attr):
        return getattr(self.f, attr)


class _RecordedSlice:
    def __init__(self, s, file, key):
        self.s, self.file, self.key = s, file, key

    def __getitem__(self, index):
        t = self.s[index]
        self.file.reads.append((dist.get_rank(), self.file.name, self.key, t.numel()))
        return t

    def __getattr__(self, attr):
        return getattr(self.s, attr)


def _local_logits(pm):
    return pm(*pm.plan.local_inputs(IDS)).logits.detach().clone()


def _assert_gathered(outs, want):
    # rank = 2 * dp + tp: ranks 0 and 2 hold the two batch shards, 1 and 3 the same ones again
    torch.testing.assert_close(torch.cat(outs[::2]), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(outs[1::2]), want, atol=1e-5, rtol=0)


def test_hf_checkpoint_fills_a_meta_built_llama_each_rank_reading_its_slices(tmp_path, monkeypatch):
    single, want, ref = _saved(tmp_path, tied=False)
    sharded, _, _ = _saved(tmp_path, tied=False, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 2
    whole = load_file(os.path.join(single, "model.safetensors"))
    lacking, misshapen = str(tmp_path / "lacking"), str(tmp_path / "misshapen")
    for path, change in ((lacking, lambda sd: sd.pop("model.norm.weight")),
                         (misshapen, lambda sd: sd.update({"model.norm.weight": torch.ones(16)}))):
        os.makedirs(path)
        sd = dict(whole)
        change(sd)
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(tied=False))
    log = _RecordReads(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", log)

    def run(rank):
        pm = _parallelize(model)
        pm.to_empty(device="cpu")   # the graph computes on the mesh's device, not meta (ParallelModule)
        local = {n: p.numel() for n, p in pm.named_parameters()}
        assert autopar.checkpoint.load_hf(pm, single) == ([], [])
        out_single = _local_logits(pm)
        inv_freq = dict(pm.store.named_buffers())["model.rotary_emb.inv_freq"].clone()
        with torch.no_grad():
            for t in [*pm.parameters(), *pm.store.buffers()]:   # garbage again, as after to_empty
                t.fill_(float("nan"))
        autopar.checkpoint.load_hf(pm, sharded)
        out_sharded = _local_logits(pm)
        with pytest.raises(autopar.PlanError, match=r"no tensor for \['model.norm.weight'\].*strict=False"):
            autopar.checkpoint.load_hf(pm, lacking)
        with pytest.raises(autopar.PlanError, match=r"'model.norm.weight' has shape \(16,\).*shape \(32,\)"):
            autopar.checkpoint.load_hf(pm, misshapen)
        assert autopar.checkpoint.load_hf(pm, lacking, strict=False).missing_keys == ["model.norm.weight"]
        return local, out_single, out_sharded, inv_freq

    results = run_threaded(4, run)
    _assert_gathered([r[1] for r in results], want)
    _assert_gathered([r[2] for r in results], want)
    for r in results:
        torch.testing.assert_close(r[3], ref.model.rotary_emb.inv_freq, atol=0, rtol=0)
    # every rank read each tensor once per checkpoint, exactly as many elements as its shard holds
    whole_numel = sum(t.numel() for t in whole.values())
    for rank, (local, *_) in enumerate(results):
        for path in (single, sharded):
            reads = [(key, n) for r, where, key, n in log.reads if r == rank and where == path]
            assert sorted(reads) == sorted(local.items()), rank
            assert sum(n for _, n in reads) < whole_numel / 2   # fsdp+tp 2 x 2: no rank reads half the model


def test_tied_llama_in_a_wrapper_loads_with_key_map_and_warns_of_a_buffer_none_recomputes(tmp_path):
    path, want, _ = _saved(tmp_path, tied=True)
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))   # stored once

    class Scaled(torch.nn.Module):
        """A wrapper as users write them: the HF model under `model.`, and a non-persistent buffer of its
        own that no initializer sets."""

        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(_config(tied=True))
            self.register_buffer("scale", torch.full((), 2.0), persistent=False)

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits * self.scale

    with torch.device("meta"):
        model = Scaled()
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight

    def run(rank):
        pm = _parallelize(model)
        pm.to_empty(device="cpu")   # the graph computes on the mesh's device, not meta (ParallelModule)
        with pytest.raises(autopar.PlanError, match=r"no tensor for \[.model\.model\..*key_map=lambda"):
            autopar.checkpoint.load_hf(pm, path)
        assert autopar.checkpoint.load_hf(pm, path, key_map=lambda k: "model." + k) == ([], [])
        pm.load_state_dict({"scale": torch.full((), 2.0)}, strict=False)   # what the warning says to do
        return pm(*pm.plan.local_inputs(IDS)).detach().clone()

    with pytest.warns(UserWarning, match=r"non-persistent buffer\(s\) \['scale'\]"):
        outs = run_threaded(4, run)
    _assert_gathered(outs, want * 2)
