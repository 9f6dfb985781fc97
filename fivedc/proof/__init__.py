"""The proof, before any process starts, that every process group's ranks agree.

comm_program.py  what a rank issues on the wire in one step, expanded from the plan per rank class
zero3_program.py its ZeRO-3 gathers and reduce-scatters by group (no pipeline)
events.py        one collective or transfer as the proof compares them
agreement.py     every group's members issue the same collectives, shapes and order; transfers pair up

Layer 6: may import `fivedc.plan`, `fivedc.estimates`, `fivedc.passes`, `fivedc.ir`.
`fivedc/pipeline.py` (layer 7) runs it on every compile.
"""
