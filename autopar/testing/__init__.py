"""Check a parallel module against the single-device one.

Two ways to run N ranks on a CPU:
- run_threaded: N threads of this process on torch's threaded process group.
  Starts in milliseconds; the workhorse of the test suite.
- run_gloo: N real processes talking gloo over localhost TCP. Slow to start
  (each process imports torch) but nothing is simulated; for end-to-end checks.

Plus toy models (MLP, GPT) and single_device_reference, which records the
numbers a parallel run must reproduce.
"""

import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn import functional as F

from .._compat import RankError, run_threaded

__all__ = ["run_threaded", "run_gloo", "RankError", "MLP", "GPTConfig", "GPT", "GPTWithLoss", "WithLabels",
           "gpt_loss", "single_device_reference"]


# -----------------------------------------------------------------------------
# real multi-process gloo

def _free_port() -> int:
    # The port is free now; rank 0 binds it a moment later. A race with another
    # program is possible but rare, and shows as an init error, not a hang.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world_size, port, result_dir, fn, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, *args)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    except BaseException:
        # A failing rank makes its peers fail too (connection closed), and
        # spawn may report a peer first; the time tells the parent the cause.
        # Written before destroy_process_group, i.e. before peers can notice.
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    # written only on success: a missing file means the rank failed
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))


def _first_failure(result_dir, rank, msg):
    failures = []
    for name in os.listdir(result_dir):
        if name.endswith(".err"):
            with open(os.path.join(result_dir, name)) as f:
                when, tb = f.read().split("\n", 1)
            failures.append((float(when), int(name[4:-4]), tb))
    return min(failures)[1:] if failures else (rank, msg)


def run_gloo(world_size: int, fn, *args, timeout: float = 300) -> list:
    """Run fn(rank, *args) in world_size processes joined by a gloo process group.

    fn must be a module-level function (processes are spawned, so fn and args
    are pickled). Returns fn's return values in rank order (saved with
    torch.save, so tensors, dicts and numbers all travel). If a rank raises,
    the others are killed and RankError carries that rank's traceback. If the
    run exceeds timeout seconds, all processes are killed and TimeoutError raised.
    """
    with tempfile.TemporaryDirectory(prefix="autopar_gloo_") as result_dir:
        # Children read OMP_NUM_THREADS when they import torch, before any of
        # our code runs in them, so it must be in the environment they inherit.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            ctx = mp.start_processes(
                _gloo_worker, args=(world_size, _free_port(), result_dir, fn, args),
                nprocs=world_size, join=False, start_method="spawn")
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        try:
            deadline = time.monotonic() + timeout
            # join returns False while any process runs, raises if one failed
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"run_gloo: {world_size} ranks did not finish "
                                       f"within {timeout} s (deadlock in a collective?)")
        except mp.ProcessRaisedException as e:
            rank, tb = _first_failure(result_dir, e.error_index, e.msg)
            raise RankError(rank, f"rank {rank} of {world_size} raised:\n{tb}") from e
        except mp.ProcessExitedException as e:
            raise RankError(e.error_index, f"rank {e.error_index} of {world_size} "
                                           f"exited: {e.msg}") from e
        finally:
            # after a timeout, a failure or Ctrl-C in the parent: no orphans
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=False))
        return results


# -----------------------------------------------------------------------------
# toy models: small, fp32, deterministic given torch.manual_seed

class MLP(nn.Module):
    """Linear layers of the given sizes with an activation between them (none after the last)."""

    def __init__(self, sizes: Sequence[int], bias: bool = True, activation: str = "gelu"):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least 2 sizes (in, out), got {list(sizes)}")
        acts = {"gelu": nn.GELU, "relu": nn.ReLU}
        if activation not in acts:
            raise ValueError(f"activation must be one of {sorted(acts)}, got {activation!r}")
        layers = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i > 0:
                layers.append(acts[activation]())
            layers.append(nn.Linear(n_in, n_out, bias=bias))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # separate q, k, v (not nanoGPT's fused c_attn) so each is a plain
        # Linear a sharding rule can split by heads on its own
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # No key bias: it shifts every score in a softmax row equally, so its gradient is
        # exactly zero and Adam would turn rounding noise in it into lr-sized updates.
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_head, hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, hs).transpose(1, 2)
        # no attention dropout: config.dropout acts on the residual branches only
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.o(y))


class Block(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.dropout(self.proj(self.gelu(self.fc(self.ln_2(x)))))
        return x


class GPT(nn.Module):
    """nanoGPT without weight tying: idx [B, T] int64 -> logits [B, T, vocab_size]."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx):
        # B and T come from the input, so torch.export keeps them symbolic
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTWithLoss(GPT):
    """nanoGPT's own signature: forward(idx, targets=None) -> (logits, loss), the loss computed inside.

    Targets of -1 are not counted (nanoGPT's ignore_index), so a batch split unevenly
    over padding still averages over the counted targets only."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class WithLabels(nn.Module):
    """A Hugging Face model called as its authors call it for training: model(input_ids=..., labels=...),
    returning its ModelOutput (loss and logits). torch.export takes positional example inputs, hence
    this thin wrapper."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels)


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM as a tensor -> tensor module: autopar plans the logits
    (HF models return a ModelOutput and take keyword arguments)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny_llama(num_layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> nn.Module:
    """Hugging Face Llama in miniature (vocab 64, up to 32 positions), as a LogitsOnly module in train
    mode. The defaults are grouped-query attention: 4 query heads share 2 key/value heads, so tp=2
    gives each rank one. Needs transformers (a test dependency)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=num_layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                      use_cache=False, attn_implementation="sdpa")
    return LogitsOnly(LlamaForCausalLM(cfg)).train()


def gpt_loss(logits, targets):
    """Mean cross-entropy over all B*T positions."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# -----------------------------------------------------------------------------
# the reference a parallel run is compared with

def single_device_reference(model_fn, inputs, targets, loss_fn, steps=3, lr=1e-2, optimizer=None) -> dict:
    """Train model_fn() on one device and record what a parallel run must reproduce.

    model_fn returns a freshly seeded model (call it again for the parallel
    run and both start from the same weights). inputs is one tensor or a tuple
    of them (passed as model(*inputs)). Every step uses the same full batch:
    loss = loss_fn(model(*inputs), targets); loss.backward(); optimizer(lr).step()
    (`optimizer`: a torch.optim class, AdamW by default; SGD shows a wrong gradient scale, Adam hides it).

    Returns a dict:
      outputs: model output of step 1 (before any update), detached
      grads:   {param name: grad of step 1}, cloned (params without a grad left out)
      params:  {param name: value after all `steps` optimizer steps}, cloned
      losses:  [loss of step 1, ..., loss of step `steps`] as floats
    """
    model = model_fn()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    opt = (optimizer or torch.optim.AdamW)(model.parameters(), lr=lr)
    record = {"outputs": None, "grads": {}, "params": {}, "losses": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(*inputs)
        loss = loss_fn(out, targets)
        loss.backward()
        if step == 0:
            record["outputs"] = out.detach().clone()
            record["grads"] = {n: p.grad.detach().clone()
                               for n, p in model.named_parameters() if p.grad is not None}
        record["losses"].append(loss.item())
        opt.step()
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def parallel_record(rank: int, model: nn.Module, mesh_shape: tuple, axis_names: tuple, inputs, targets,
                    loss_fn, steps: int = 3, lr: float = 1e-2, plan_kwargs: dict | None = None,
                    optimizer=None) -> dict:
    """The parallel counterpart of single_device_reference, run on one rank.

    `model` is the same freshly seeded single-device model (a copy is taken),
    inputs/targets are the global batch. Records this rank's outputs of step
    1, the whole gradients of step 1, the whole parameters after all steps,
    the local losses, the plan and the collectives logged during step 1.
    """
    import copy

    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    model = copy.deepcopy(model)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    pm = autopar.parallelize(model, mesh, inputs, record_comm=True, **(plan_kwargs or {}))
    local_in = pm.plan.local_inputs(*inputs)
    (local_targets,) = pm.plan.local_targets(targets)
    # the wrapper steps ZeRO parameters on their slices; other parameters it passes through
    opt = autopar.ShardedOptimizer(pm, optimizer or torch.optim.AdamW, lr=lr)
    record = {"outputs": None, "grads": {}, "params": {}, "losses": [], "plan": pm.plan, "comm": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if step == 0:
            pm.comm.log.records.clear()
        out = pm(*local_in)
        loss = loss_fn(out, local_targets)
        loss.backward()
        if step == 0:
            record["outputs"] = out.detach().clone()
            record["grads"] = opt.full_grads()
        record["losses"].append(loss.item())
        opt.step()
        if step == 0:
            # after step(): ZeRO's collectives run there; full_grads()'s own are not the step's
            record["comm"] = [r for r in pm.comm.log.records if r[3] != "checkpoint"]
    record["params"] = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    return record
