"""Compiler passes and the planning decisions, run in the order of `fivedc/pipeline.py`.

Graph passes (each a pure Graph -> Graph function): verify.py, support.py, shapes.py,
context.py (CP sequence split), experts.py (EP placement), propagate.py with rules.py
and layout.py (DP/TP/SP/CP shardings), gradients.py, communication.py with
expert_collectives.py. Planning decisions on the compiled graph: stage_plan.py
(pipeline chunks and schedule) with stages.py (units and chunks), stage_costs.py,
stage_cuts.py, stage_marks.py (the model's marks), microbatch_checks.py,
stage_values.py (what crosses a cut) and chunk_params.py (what a chunk holds),
recompute.py (what recomputes),
regather.py (what sequence parallelism gathers again in backward), param_sync.py (ZeRO's chunks and collectives),
overlap.py (gradient buckets).
base.py holds `CompileOptions` and the `Pass` protocol.

Layer 3: may import `fivedc.schedule` and `fivedc.ir`; never torch.distributed.
"""
