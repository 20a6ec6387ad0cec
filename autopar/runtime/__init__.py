"""Runtime: the plan applied on each rank, as a module that trains like the single-device one.

Takes the `Captured` graph and a `Plan`; hands on `ParallelModule` (module.py): this rank's
shards of the parameters and a local fx graph with every collective inserted, plus
`ShardedOptimizer` (optim.py) for ZeRO-1/2 and the pipeline's stages when the plan has them.

Reading order: collectives.py (collectives as autograd functions: each backward is the
conjugate collective), rewrite.py (global graph -> local graph), recompute.py (checkpointed
blocks), module.py (the module users train), initialization.py (a meta-built
model's shards initialized from scratch), optim.py, stages.py (pipeline stages under torch's
schedules). Filling the shards from a checkpoint is autopar/checkpoint/'s job.
"""
