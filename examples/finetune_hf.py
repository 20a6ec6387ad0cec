"""Fine-tune a Hugging Face causal LM from a `save_pretrained` directory, each rank loading only its shards.

    python examples/finetune_hf.py --make-tiny /tmp/tiny-llama     # once: a small random Llama to try it on
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model /tmp/tiny-llama --text README.md --steps 5

The model is built on the meta device from the directory's config.json (no memory for weights), planned
by autopar for a 2-axis mesh of the ranks, and `autopar.load_hf_checkpoint` fills each rank's shards,
reading from the safetensors files only the slices it holds. The loss is the model's own: HF's `labels=`.

The text file becomes token ids (the directory's tokenizer if it has one, else its bytes), cut into
sequences. Each rank reads only its share of every batch, as a data loader would
(`plan.data_shard()` -> a DistributedSampler), and rank 0 prints the loss of each step.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar

try:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
except ImportError:
    raise SystemExit("this example needs Hugging Face transformers: python -m pip install transformers")


class CausalLMLoss(torch.nn.Module):
    """The model as its authors call it for training: input ids and labels in, the mean loss out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def make_tiny(path: str) -> None:
    """A 2-layer random Llama saved as save_pretrained saves a real one."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(path)
    print(f"a random 2-layer Llama saved to {path}")


def token_ids(model_dir: str, text_path: str, vocab_size: int) -> torch.Tensor:
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return torch.tensor(tokenizer(text)["input_ids"])
    except (OSError, ValueError):   # no tokenizer in the directory: bytes, folded into the vocabulary
        return torch.tensor(list(text.encode("utf-8"))) % vocab_size


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a save_pretrained directory (config.json and safetensors)")
    p.add_argument("--make-tiny", metavar="DIR", help="save a small random Llama to DIR and exit")
    p.add_argument("--text", default="README.md", help="the text to train on (default: README.md)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default: 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: 64)")
    # fsdp by default: weights split over every rank, as a model too big for one needs, and each rank
    # reads its own share of the batch; "auto" keeps a model this small whole and the batch unsplit
    # (on loopback TCP every collective costs more than the compute it would spread)
    p.add_argument("--strategy", default="fsdp", choices=autopar.STRATEGIES, help="default: fsdp")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    if args.make_tiny:
        return make_tiny(args.make_tiny)
    if not args.model:
        p.error("give --model DIR (or make one with --make-tiny DIR)")
    if "RANK" not in os.environ:
        sys.exit("run it with torchrun, e.g. torchrun --nproc-per-node 4 examples/finetune_hf.py --model DIR")

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (2, world // 2) if world % 2 == 0 and world > 2 else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("x", "y")[:len(shape)])

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    with torch.device("meta"):
        model = CausalLMLoss(AutoModelForCausalLM.from_config(config))
    example = torch.zeros(args.batch, args.seq, dtype=torch.long)
    pm = autopar.parallelize(model, mesh, (example, example), strategy=args.strategy)
    pm.to_empty(device="cpu")
    autopar.load_hf_checkpoint(pm, args.model, key_map=lambda k: "model." + k)
    if rank == 0:
        print(pm.plan)

    ids = token_ids(args.model, args.text, config.vocab_size)
    sequences = ids[: len(ids) // args.seq * args.seq].view(-1, args.seq)
    index, count = pm.plan.data_shard()
    sampler = DistributedSampler(TensorDataset(sequences), num_replicas=count, rank=index, shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(sequences), batch_size=args.batch // count, sampler=sampler, drop_last=True)
    if rank == 0:
        print(f"\n{len(sequences)} sequences of {args.seq} tokens; this rank reads share {index} of {count}, "
              f"{args.batch // count} sequences a step")
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=args.lr)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)   # another order each pass over the text, the same on every rank
        epoch += 1
        for (x,) in loader:
            opt.zero_grad(set_to_none=True)
            loss = pm(x, x)   # labels = the inputs: HF shifts them inside
            loss.backward()
            opt.step()
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}")
            step += 1
            if step == args.steps:
                break
    # every rank gets here before any tears gloo down: a rank that leaves while a peer still talks to it
    # can abort the peer (as examples/train_gpt.py does)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
