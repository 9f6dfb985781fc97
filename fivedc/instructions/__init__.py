"""Each class of ranks' training step as instructions, expanded from the plan's graph.

sites.py         where the graph computes its values, in program order (ids, pp ranks, groups)
comm_program.py  the expander: per class (a pp rank), its step as shared runs of instructions
                 (each op's forward and backward, its collectives, transfers, the optimizer
                 step)
pipeline_events.py  its schedule's actions: chunks' runs, sends and receives, what comes first
kernel_events.py what kernels send inside; sync_events.py the gradients' and parameters' sums
zero3_program.py its ZeRO-3 gathers and reduce-scatters by group (no pipeline)
param_facts.py   the parameters a class holds and their sizes
unit_program.py  one unit's instructions (`unit_instructions`), each naming its node and part
done_again.py    what backward does again, read back from the lists (recomputed ops and layers,
                 SP's gathers again): what the runtime and the memory model act on
events.py        one instruction (a collective, a transfer or a computation); a run of them

What reads these lists: the agreement proof (`fivedc/proof/`, the collectives and
transfers), the step-time model (`fivedc/estimates/unit_costs.py`, each unit's), the memory
model and the runtime (what backward does again: `done_again.py`), `fivedc show PLAN
--program`, and the tests that hold the runtime's calls to them.

Between `fivedc.passes` and `fivedc.estimates` (tests/test_imports.py): may import
`fivedc.passes`, `fivedc.schedule` and `fivedc.ir`.
"""
