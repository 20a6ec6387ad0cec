"""Pipeline: stages.py cuts the local graph into stages and wraps each as a module; runner.py holds this
device's stages and runs ParallelModule.train_step over them under torch.distributed.pipelining's schedules."""
