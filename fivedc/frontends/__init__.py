"""Frontends: a model as text or as an nn.Module, to the IR.

dsl_file.py     a `.5d` file (the grammar `grammars/fivedc.lark`, lowered by `dsl/`)
fx_module.py    an nn.Module captured with torch.fx or torch.export (the parts in `fx/`)
python_file.py  `path/file.py:factory`, the factory returning (module, example_inputs)
weightless.py   `empty_weights()`: a module built without its parameters' values, for planning

Layer 5: may import `fivedc.ir` and `fivedc.passes` (shapes, rules); never the plan,
the runtime or the CLI.
"""
