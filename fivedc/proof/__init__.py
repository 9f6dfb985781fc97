"""The proof, before any process starts, that every process group's ranks agree.

comm_program.py  what a rank issues on the wire in one step, expanded from the plan per rank class,
                 as shared runs (a repeat's layer built once for all its layers)
pipeline_events.py  its schedule's actions: chunks' runs, sends and receives, what comes first
kernel_events.py what kernels send inside; sync_events.py the gradients' and parameters' sums
zero3_program.py its ZeRO-3 gathers and reduce-scatters by group (no pipeline)
events.py        one collective or transfer as the proof compares them; a run of them
agreement.py     every group's members issue the same collectives, shapes and order; transfers pair up

Layer 6: may import `fivedc.plan`, `fivedc.estimates`, `fivedc.passes`, `fivedc.ir`.
`fivedc/pipeline.py` (layer 7) runs it on every compile.
"""
