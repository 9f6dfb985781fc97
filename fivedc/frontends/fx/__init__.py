"""The torch.fx frontend's parts; `fivedc/frontends/fx_module.py` is the entry point.

trace.py (tracing, repeated layers as one body, shape propagation) and export.py
(the torch.export fallback) -> patterns.py + attention_patterns.py (rewrites: fused
qkv, heads views, RMSNorm, SwiGLU, hand-written attention) -> lower.py, ops.py,
layers.py, attention_lower.py (fx nodes to IR ops; recognise.py names ops and modules,
moe.py reads MoE blocks, moe_leaves.py keeps them whole while tracing, moe_lower.py
lowers them) -> dims.py
(dim names by role) -> marks.py (pipeline stage marks) -> build.py (the IR Graph)
and params.py (the state_dict <-> IR parameter map); locs.py finds the user's file
and line for every node.
"""
