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

from library_models import assert_compiles_or_is_refused_at_its_line  # noqa: E402

ARCHITECTURES = (
    "titan_llama3", "titan_llama3_sdpa", "titan_qwen3_sdpa", "titan_qwen3_moe_sdpa", "titan_deepseek_v3_sdpa",
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
