"""The DSL's lowering from a lark tree to the IR (`fivedc/frontends/dsl_file.py` is the entry).

lower.py    statements to IR: SSA naming, calls, annotations, repeat blocks, @stage marks
decls.py    the dims block, inputs and parameters (shapes, inits, dtypes)
values.py   literals and integer dim expressions; `close` for did-you-mean hints
"""
