"""The layout search: the fastest mesh and plan options for a model on a cluster.

search.py   `search(graph, gpus=, hardware=)`: every candidate scored by the compiler's own
            planning passes (`fivedc/pipeline.py`) on a draft sharing per-layer figures
            (`fivedc/estimates/memo.py`), pruned by reason, ranked, the best compiled
space.py    the candidates: meshes, rank orders, SP, CP variant, schedules, ZeRO, recompute

Used by `fivedc search` (`fivedc/cli/search.py`) and `parallelize(mesh="auto")`.
Layer 7, just above `fivedc.pipeline` (tests/test_imports.py: between it and the
frontends): may import the pipeline and everything below; never the frontends, the
runtime, parallel or the CLI.
"""
