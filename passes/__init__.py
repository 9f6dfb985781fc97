"""Compiler passes: pure IR -> IR functions, run in the order of `fivedc/pipeline.py`."""
