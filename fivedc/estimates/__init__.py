"""Estimates: the cost, memory and step time of a plan before it runs.

costs.py        work and time per op on given hardware
unit_costs.py   seconds per pipeline unit: its ops and collectives, less what hides behind compute
gemm.py         one GEMM's seconds from its shape: tiles in waves over the SMs, its memory roofline
saved.py        what each op keeps for backward (the runtime kernels' save rules)
activations.py  activation bytes per unit and microbatch, with recomputation
transient.py    transient peaks: gathered layers, buckets, all-to-all buffers, logits
memory.py       memory per class of ranks: params, grads, optimizer, activations, transient
step_time.py    seconds per step, bubble, tokens/s and MFU from the costs and the schedule

Layer 4: may import `fivedc.instructions`, `fivedc.passes`, `fivedc.schedule` and `fivedc.ir`.
"""
