"""Fine-tune a Hugging Face causal LM from a `save_pretrained` directory, each rank loading only its shards.

    python examples/finetune_hf.py --make-tiny /tmp/tiny-llama     # once: a small random Llama to try it on
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model /tmp/tiny-llama --text README.md --steps 5

The model is used as its authors ship it: built from the directory's config.json (its default
`use_cache=True` included) on the meta device (no memory for weights), called with keywords as every HF
training loop calls it, `out = pm(**batch)`, and trained on `out.loss` (HF's `labels=`). autopar plans it
for a 2-axis mesh of the ranks, and `autopar.checkpoint.load_hf` fills each rank's shards, reading from the
safetensors files only the slices it holds.

Each line of the text file is one example (the directory's tokenizer if it has one, else its bytes),
cut to --seq tokens and padded on the right as a collator pads: `attention_mask` 0 and `labels` -100 on the
padding. Each rank reads only its share of every batch, as a data loader would (`plan.data_shard()` -> a
DistributedSampler), and rank 0 prints the loss of each step.
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


def make_tiny(path: str) -> None:
    """A 2-layer random Llama saved as save_pretrained saves a real one."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(path)
    print(f"a random 2-layer Llama saved to {path}")


def tokenize(model_dir: str, vocab_size: int):
    """text -> token ids: the directory's tokenizer, or (none there) the text's bytes folded into the vocabulary."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return lambda text: tokenizer(text)["input_ids"]
    except (OSError, ValueError):
        return lambda text: [b % vocab_size for b in text.encode("utf-8")]


def padded_examples(text_path: str, tokenize, seq: int, pad_id: int = 0) -> TensorDataset:
    """One example per non-empty line, cut to `seq` tokens and padded on the right, as HF's collators do:
    (input_ids, attention_mask with 0 on padding, labels with -100 on padding)."""
    with open(text_path, encoding="utf-8") as f:
        lines = [ids[:seq] for ids in (tokenize(line.strip()) for line in f) if len(ids) > 1]
    input_ids = torch.full((len(lines), seq), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lines), seq, dtype=torch.long)
    for row, ids in enumerate(lines):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    return TensorDataset(input_ids, mask, input_ids.masked_fill(mask == 0, -100))


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

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)   # use_cache=True, as shipped
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # a global batch of the shapes training uses: the plan is made for them (the values do not matter)
    example = {"input_ids": torch.zeros(args.batch, args.seq, dtype=torch.long),
               "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
               "labels": torch.zeros(args.batch, args.seq, dtype=torch.long)}
    pm = autopar.parallelize(model, mesh, example_kwargs=example, strategy=args.strategy)
    pm.to_empty(device="cpu")
    autopar.checkpoint.load_hf(pm, args.model)
    if rank == 0:
        print(pm.plan)

    dataset = padded_examples(args.text, tokenize(args.model, config.vocab_size), args.seq)
    index, count = pm.plan.data_shard()
    sampler = DistributedSampler(dataset, num_replicas=count, rank=index, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch // count, sampler=sampler, drop_last=True)
    if rank == 0:
        print(f"\n{len(dataset)} examples padded to {args.seq} tokens; this rank reads share {index} of {count}, "
              f"{args.batch // count} examples a step")
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=args.lr)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)   # another order each pass over the text, the same on every rank
        epoch += 1
        for input_ids, attention_mask, labels in loader:   # this rank's share of the batch
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            opt.zero_grad(set_to_none=True)
            out = pm(**batch)   # HF shifts the labels inside; out.past_key_values is None (no cache in training)
            out.loss.backward()
            opt.step()
            if rank == 0:
                print(f"step {step}: loss {out.loss.item():.4f}")
            step += 1
            if step == args.steps:
                break
    # every rank gets here before any tears gloo down: a rank that leaves while a peer still talks to it
    # can abort the peer (as examples/train_gpt.py does)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
