"""The proof, before any process starts, that every process group's ranks agree.

agreement.py     every group's members issue the same collectives, shapes and order; transfers pair up

It reads the instruction lists `fivedc/instructions/` expands.
Layer 6: may import `fivedc.plan`, `fivedc.estimates`, `fivedc.instructions`, `fivedc.passes`, `fivedc.ir`.
`fivedc/pipeline.py` (layer 7) runs it on every compile.
"""
