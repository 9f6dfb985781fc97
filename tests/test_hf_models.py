"""Models written by others: every Hugging Face architecture of `examples/hf_models.py`.

Built from the library itself (tiny configs, random weights, no downloads).
docs/compatibility.md has the full matrix and the reasons. What must hold for each,
whatever it is: it compiles, or it is refused with a located bad-input error (exit
2, the user's file and line), never an internal error or a traceback; a slice of
them that compiles also verifies on one rank here.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from library_models import assert_compiles_or_is_refused_at_its_line  # noqa: E402

# verified on one rank here (a slice: the Llama family differs little; llama itself is verified on
# dp2·tp2 and cp2 below); the others compile or are refused here, and are verified in the matrix
VERIFIED_HERE = ("qwen3", "mixtral", "deepseek_v3")  # gemma, gpt2: in parallel below; all: the matrix
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gpt2", "mixtral", "qwen3_moe",
                 "deepseek_v3")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_library_model_compiles_or_is_refused_at_its_line(arch: str) -> None:
    # the full matrix: benchmarks/compatibility.py -> docs/compatibility.md
    assert_compiles_or_is_refused_at_its_line(f"examples/hf_models.py:{arch}", verify=arch in VERIFIED_HERE)


def test_the_examples_list_every_architecture() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_models", "examples/hf_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ARCHITECTURES == ARCHITECTURES


@pytest.mark.parametrize("arch, mesh, options", [
    ("gpt2", "1x1x1x2x1", {}),  # Conv1D as addmm, tanh GELU on shards, tied table
    ("gemma", "1x1x1x2x1", {}),  # its RMSNorm (1 + w) on shards, scaled embedding, tied table
    ("llama_logits", "1x2x1x1x1", {"microbatches": 2}),  # pipeline stages at the inlined layers
])
def test_library_models_train_in_parallel(worker_pool, arch: str, mesh: str, options: dict) -> None:
    """Each with what it brought: the run equals the module's in float64 (dropout off in both: the IR
    has none, and the frontend says so at its line)."""
    from fivedc.parallel.check import check_module

    report = check_module(f"examples/hf_models.py:{arch}", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                          **options)
    assert report.max_error <= 1e-10, report


@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x1x2x1"])
def test_hugging_face_llama_trains_with_its_own_loss(worker_pool, mesh: str) -> None:
    """LlamaForCausalLM(input_ids, labels=labels).loss as the library computes it: its label shift
    runs replicated, its rotary frequencies are its own float32 table's, and under dp·tp with SP
    and under cp the run equals the module's in float64."""
    from fivedc.parallel.check import check_module

    report = check_module("examples/hf_models.py:llama", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                          sequence_parallel=True)
    assert report.max_error <= 1e-10, report
