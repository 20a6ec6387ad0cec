"""Toy models the tests parallelize: small, fp32, deterministic given torch.manual_seed.

MLP and a nanoGPT-style GPT (with GPTWithLoss, the variant that computes its
loss inside forward), MegatronStack (the layer whose activations Korthikanti et
al. count), plus thin wrappers that make Hugging Face models exportable
(WithLabels, LogitsOnly) and tiny_llama.
"""

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch.nn import functional as F

__all__ = ["MLP", "GPTConfig", "CausalSelfAttention", "Block", "GPT", "GPTWithLoss", "WithLabels", "LogitsOnly",
           "MegatronLayer", "MegatronStack", "tiny_llama"]


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


class MegatronLayer(nn.Module):
    """A transformer layer as "Reducing Activation Recomputation in Large Transformer Models"
    (Korthikanti et al.) counts its activations: attention written out (scores, softmax, dropout,
    weighted sum; no mask), dropout after attention and after the MLP, a GELU MLP of 4h."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        # no key bias: its gradient is exactly zero (it shifts a softmax row evenly; see CausalSelfAttention)
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.attn_dropout, self.dropout_1 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.dropout_2 = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        y = self.ln_1(x)
        q, k, v = (f(y).view(b, s, self.heads, d).transpose(1, 2) for f in (self.q, self.k, self.v))
        probs = self.attn_dropout(((q @ k.transpose(-2, -1)) * d ** -0.5).softmax(-1))
        attended = (probs @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.dropout_1(self.o(attended))
        return x + self.dropout_2(self.fc2(F.gelu(self.fc1(self.ln_2(x)))))


class MegatronStack(nn.Module):
    """`num_layers` MegatronLayers: x [b, s, hidden] -> [b, s, hidden]."""

    def __init__(self, num_layers: int = 2, hidden: int = 32, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(hidden, heads, dropout) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def tiny_llama(num_layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> nn.Module:
    """Hugging Face Llama in miniature (vocab 64, up to 32 positions), as a LogitsOnly module in train
    mode. The defaults are grouped-query attention: 4 query heads share 2 key/value heads, so tp=2
    gives each rank one. Needs transformers (a test dependency)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=num_layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                      use_cache=False, attn_implementation="sdpa")
    return LogitsOnly(LlamaForCausalLM(cfg)).train()


def seeded_gpt(n_layer: int = 3, dropout: float = 0.0) -> tuple:
    """(GPT in train mode, inputs, targets): a GPT of `n_layer` blocks (2 heads, width 16, vocab 32, 8
    positions) and a batch of 4 sequences, all drawn from seed 0 -- the recompute tests' shared case."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=dropout)
    return GPT(cfg).train(), torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))


def pipeline_gpt() -> GPT:
    """The pipeline tests' model, drawn from seed 0: a 4-block GPT (GPTConfig's small defaults otherwise), deep
    enough for two devices of two interleaved stages each."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4))


def pipeline_batch() -> tuple:
    """(inputs, targets) for pipeline_gpt, drawn from seed 1: 8 sequences of 16 tokens, 2 per microbatch at 4."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def seeded_llama(num_layers: int = 3) -> tuple:
    """(tiny_llama of `num_layers` layers, inputs, None) drawn from seed 0: a batch of 4 sequences of 16."""
    torch.manual_seed(0)
    return tiny_llama(num_layers=num_layers), torch.randint(0, 64, (4, 16)), None


def shipped_causal_lm(family: str) -> nn.Module:
    """A Hugging Face causal LM of `family` ("llama", "qwen2", "gpt2") as its authors ship it: the family's
    default config (use_cache=True, its default attention implementation, GPT-2's tied embeddings) shrunk
    to 2 layers of width 32 over a vocabulary of 64, in train mode. Called with keywords and `labels=`.

    GPT-2's default dropout (0.1) is set to 0: a one-device comparison needs the same masks, which no
    split of the batch draws (tests/test_dropout_rng.py tests dropout on its own)."""
    import transformers
    small = dict(vocab_size=64, num_hidden_layers=2)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).train()
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    cfg = config_class(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, **small)
    return model_class(cfg).train()


def padded_batch(batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 0) -> dict:
    """A tokenized batch as a Hugging Face collator gives it: input_ids, attention_mask (0 on padding) and
    labels (-100 on padding). Rows are padded unevenly -- on the right, not at all, on the left, a lot on
    the left -- so the shards of a split batch hold different numbers of counted tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    pads = [("right", 3), ("none", 0), ("left", 2), ("left", seq // 2 + 1)]
    for row in range(batch):
        side, n = pads[row % len(pads)]
        if side == "right" and n:
            mask[row, -n:] = 0
        elif side == "left" and n:
            mask[row, :n] = 0
    input_ids[mask == 0] = 0    # the pad token
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
