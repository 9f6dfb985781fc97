"""The IR: what a model is and what it runs on, as plain frozen data.

graph.py       the Graph: named dims, inputs, parameters, ops, repeat blocks, redistributions
ops.py         the op vocabulary: every op kind, its arguments and attributes
pointwise.py   a pointwise op's own facts: its kernel's torch function, save form, fx names
sharding.py    a tensor's sharding: which mesh axes split which dims, pending sums
mesh.py        the 5-D device mesh: sizes, rank order, coordinates, groups
seq_layout.py  how the sequence lies over the cp axis (contiguous, balanced)
aten_call.py   the `aten` op: an ATen operator computed whole, with its call recorded
hardware.py    GPU profiles (hardware.toml) the estimates assume
serialize.py   JSON of the IR's (and the plan's) frozen dataclasses

Layer 1 (the bottom): imports only `fivedc.errors` and `fivedc.files`, never torch.
"""
