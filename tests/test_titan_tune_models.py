"""Models written by others, second source: torchtitan and torchtune decoders of
`examples/titan_tune_models.py` (built from the libraries themselves, tiny configs,
random weights, no downloads; its docstring says how to install them without moving torch).

The rule of tests/test_hf_models.py: each compiles, or is refused with a located
bad-input error (exit 2, a file and line), never an internal error or a traceback;
one that compiles also verifies on one rank in float64.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("torchtune")

from fivedc.cli.main import load_graph  # noqa: E402
from library_models import assert_compiles_or_is_refused_at_its_line  # noqa: E402

ARCHITECTURES = (
    "titan_llama3", "titan_llama3_sdpa", "titan_qwen3", "titan_qwen3_sdpa", "titan_qwen3_moe_sdpa",
    "titan_deepseek_v3", "titan_deepseek_v3_sdpa",
    "tune_llama2", "tune_llama3", "tune_llama3_2", "tune_qwen2", "tune_mistral", "tune_phi3", "tune_gemma",
    "tune_gemma2",
)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_library_model_compiles_or_is_refused_at_its_line(arch: str) -> None:
    assert_compiles_or_is_refused_at_its_line(f"examples/titan_tune_models.py:{arch}")


def test_the_examples_list_every_architecture() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("titan_tune_models", "examples/titan_tune_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ARCHITECTURES == ARCHITECTURES
    assert all(callable(getattr(module, arch)) for arch in ARCHITECTURES)


def test_torchtitans_default_llama3_with_flex_attention_trains_as_one_device(worker_pool) -> None:
    """torchtitan's llama3 with its default attention, a compiled flex_attention over a compiled
    document block mask (fivedc/frontends/fx/flex.py): each layer's attention is the IR's causal
    attention, nothing runs replicated, and it trains as on one device (the reference: torch's
    eager flex_attention op, in float64) under cp2 and pp2 with 1F1B."""
    from fivedc.ir.graph import walk_ops
    from fivedc.parallel.check import check_module

    graph = load_graph("examples/titan_tune_models.py:titan_llama3")
    ops = [op for op, _ in walk_ops(graph.body)]
    assert [op.attr("causal") for op in ops if op.kind == "attention"] == [True, True]
    assert not [op for op in ops if op.kind == "aten" and op.attr("rule") == "replicated"]
    for mesh, options in (("1x1x1x2x1", {}), ("1x2x1x1x1", {"schedule": "1f1b"})):
        report = check_module("examples/titan_tune_models.py:titan_llama3", mesh=mesh, steps=2, dtype="fp64",
                              pool=worker_pool, **options)
        assert report.max_error <= 1e-10, (mesh, report)
