"""The torch.fx frontend's parts; `fivedc/frontends/fx_module.py` is the entry point.

trace.py (tracing, repeated layers as one body, shape propagation) and export.py
(the torch.export fallback) -> patterns.py (rewrites: fused qkv, heads views,
RMSNorm, SwiGLU, hand-written attention) -> lower.py, ops.py, layers.py (fx nodes
to IR ops; recognise.py names ops and modules, moe.py reads MoE blocks) -> dims.py
(dim names by role) -> marks.py (pipeline stage marks) -> build.py (the IR Graph)
and params.py (the state_dict <-> IR parameter map); locs.py finds the user's file
and line for every node.
"""
