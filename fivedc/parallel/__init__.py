"""What `fivedc.parallelize` (fivedc/parallel/parallelize.py) returns and how it runs.

module.py    ParallelModule: one rank's shards of a traced module, run by the plan's Program
names.py     the module's own names and layouts for the plan's parameters (views both ways)
weights.py   where its weights live per ZeRO stage (whole shards, flat chunks, gathered on use)
grads.py     GradSync: gradients summed over their grad_partial axes before backward returns
pipeline.py  pp > 1: the forward runs the schedule; gathers across pp
pins.py      shardings pinned by module-path pattern
check.py     equivalence of a parallelized module with the plain one (fivedc verify file.py:factory)

Layer 9: may import the runtime, the frontends, the pipeline and everything below.
"""
