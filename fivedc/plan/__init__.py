"""The execution plan: the compiled graph plus everything a reader and the runtime need.

execution_plan.py  ExecutionPlan, its JSON file, and `build_plan` (assembles what the passes decided)
summary.py         the readable summary `fivedc compile` prints
diff.py            what changes between two plans (`fivedc diff`)
op_list.py         every op of a plan with its id (`fivedc show --ops`)
faults.py          a fault to inject into one op on one rank (`fivedc verify --inject-fault`)

Layer 5: may import `fivedc.estimates`, `fivedc.instructions`, `fivedc.passes`, `fivedc.schedule`, `fivedc.ir`.
"""
