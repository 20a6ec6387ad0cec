"""Pipeline: stages.py cuts the local graph into this rank's stages and runs them under
torch.distributed.pipelining's schedules (ParallelModule.train_step)."""
