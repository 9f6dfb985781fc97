"""Models written by others: every Hugging Face architecture of `examples/hf_models.py`.

Built from the library itself (tiny configs, random weights, no downloads).
docs/compatibility.md has the full matrix and the reasons; here each model is held to its
measured row (tests/library_models.py): one the table marks ok verifies on one rank in float64
and compiles at a multi-axis layout, one it records as stopped stops with that error. A slice
of them verifies in parallel here, in float64, one run per distinct path.
"""

from __future__ import annotations

import pytest

import transformers  # noqa: F401  the `test` extra installs it (pyproject.toml): missing, the tests fail

from library_models import assert_as_the_table_says, table_row  # noqa: E402

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gpt2", "mixtral", "qwen3_moe",
                 "deepseek_v3", "phi3", "olmo2", "falcon", "glm", "gptj", "nemotron", "bloom", "opt",
                 "gpt_neox", "phi", "stablelm", "starcoder2", "granite", "mpt", "gpt_bigcode", "codegen", "olmoe",
                 "granitemoe", "cohere", "exaone4", "gpt_neo", "biogpt", "arcee", "seed_oss", "qwen2_moe")
# compiled and verified in parallel by the tests below (llama, gpt2, gemma, qwen3_moe, deepseek_v3, olmo2, gptj), or
# as a logits-loss model in tests/test_fx_hf_patterns.py (qwen3): not traced again here; all: the matrix
COVERED_BELOW = ("llama", "gpt2", "gemma", "qwen3_moe", "qwen3", "deepseek_v3", "olmo2", "gptj", "qwen2_moe")
# the multi-axis layout each compiles at (agreement proof included), where not dp2·tp2: softcap attention on
# the cp ring, Mixtral's MoE blocks from the library over ep, Falcon's one k/v head over tp and its fused QKV
# split by constant positions (slices) in a pipeline's microbatches
MESHES = {"gemma2": "1x1x1x2x1", "mixtral": "1x1x1x1x2", "falcon": "1x2x2x1x1"}


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in COVERED_BELOW])
def test_a_library_model_verifies_or_stops_as_the_table_says(arch: str) -> None:
    # the full matrix: benchmarks/compatibility.py -> docs/compatibility.md
    assert_as_the_table_says(f"examples/hf_models.py:{arch}", arch, mesh=MESHES.get(arch, "2x1x2x1x1"))


def test_the_examples_list_every_architecture() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_models", "examples/hf_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ARCHITECTURES == ARCHITECTURES
    # those verified in parallel below are ok in the table, as they must be there
    assert all(table_row(arch)["1 rank"].startswith("ok") for arch in COVERED_BELOW)


@pytest.mark.parametrize("arch, mesh, options", [
    ("gpt2", "1x1x1x2x1", {}),  # Conv1D as addmm, tanh GELU on shards, tied table
    ("gemma", "1x1x1x2x1", {}),  # its RMSNorm (1 + w) on shards, scaled embedding, tied table
    ("llama_logits", "1x2x1x1x1", {"microbatches": 2}),  # pipeline stages at the inlined layers
    # multi-head latent attention: keys written slice by slice into new_empty (as cat), q and k made
    # [batch, heads, seq, head_dim] by cat (moved into the IR attention's order on shards); its MoE
    ("deepseek_v3", "2x1x2x1x1", {}),
    ("olmo2", "2x1x2x1x1", {}),  # q/k norms over all heads (weights [heads, head_dim]): heads whole for them
    # interleaved rotary by strided slices of head_dim's pairs, attention written out: matmuls on shards
    ("gptj", "1x1x1x2x1", {}),
    # its MoE block's shared expert gated by sigmoid(a linear to one feature): the routing is the moe op, so
    # the block runs in a pipeline's microbatches (it ran replicated, which a pipeline refuses)
    ("qwen2_moe", "1x2x1x1x1", {"microbatches": 2}),
])
def test_library_models_train_in_parallel(worker_pool, arch: str, mesh: str, options: dict) -> None:
    """Each with what it brought: the run equals the module's in float64 (dropout off in both: the IR
    has none, and the frontend says so at its line)."""
    from fivedc.parallel.check import check_module

    report = check_module(f"examples/hf_models.py:{arch}", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                          **options)
    assert report.max_error <= 1e-10, report


WINDOW_LAYOUTS = [("1x1x1x1x1", {}), ("2x1x2x1x1", {}), ("1x1x1x2x1", {}),
                  ("1x2x1x1x1", {"microbatches": 2, "schedule": "1f1b"})]


@pytest.mark.parametrize("mesh, options", WINDOW_LAYOUTS, ids=["1", "dp2tp2", "cp2", "pp2_1f1b"])
@pytest.mark.parametrize("arch", ["gemma2", "mistral", "gemma3"])
def test_sliding_windows_shorter_than_the_sequence_train_in_parallel(worker_pool, arch: str, mesh: str,
                                                                     options: dict) -> None:
    """A window of 4 positions in a sequence of 8: the mask is banded, not causal (the library's own
    configs have windows longer than the examples' sequences, where it is plain causal). Gemma 2's
    eager attention adds it to softcapped scores, Mistral's and Gemma 3's SDPA takes it as attn_mask;
    either is the IR's attention with window=4, and the run equals the module's in float64."""
    from fivedc.parallel.check import check_module

    kwargs = {"arch": arch, "sliding_window": 4}
    report = check_module("examples/hf_models.py:build", kwargs=kwargs, mesh=mesh, steps=2, dtype="fp64",
                          pool=worker_pool, **options)
    assert report.max_error <= 1e-10, report


@pytest.mark.parametrize("arch, windowed", [("gemma2", 1), ("mistral", 2), ("gemma3", 2)])
def test_a_sliding_window_is_the_attentions_window_and_cp_splits_it(arch: str, windowed: int) -> None:
    """The library's band (the query at i sees i - 4 < j <= i, read off the mask's value) is
    `window=4` on the attention (Gemma 2's other layer attends fully), nothing runs replicated, and
    under cp2 the attention's sequence is split over cp, not gathered on every rank."""
    from fivedc.frontends.python_file import traced_from_spec
    from fivedc.ir.aten_call import whole_dims
    from fivedc.ir.graph import Op, walk_ops
    from fivedc.ir.mesh import Mesh, MeshAxis
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph

    _, _, tm = traced_from_spec("examples/hf_models.py:build", kwargs={"arch": arch, "sliding_window": 4})
    ops = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op)]
    assert sorted(op.attr("window", 0) for op in ops if op.kind == "attention") == [0] * (2 - windowed) + [4] * windowed
    assert not [op for op in ops if op.kind == "aten" and whole_dims(op) is None]
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("1x1x1x2x1")))
    attention = [op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "attention"]
    assert all(op.sharding.axes_of(plan.graph.seq_dim) == (MeshAxis.CP,) for op in attention)


def test_hugging_face_llama_trains_with_its_own_loss(worker_pool) -> None:
    """LlamaForCausalLM(input_ids, labels=labels).loss as the library computes it: its label shift
    runs along the sequence, its rotary frequencies are its own float32 table's, and under tp with
    SP and cp together the run equals the module's in float64."""
    from fivedc.parallel.check import check_module

    report = check_module("examples/hf_models.py:llama", mesh="1x1x2x2x1", steps=2, dtype="fp64", pool=worker_pool,
                          sequence_parallel=True)
    assert report.max_error <= 1e-10, report


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])  # qwen2_moe's: its pp2 run below (replicated, refused)
def test_hugging_face_moe_blocks_are_the_irs_moe_ops(arch: str) -> None:
    """Each layer's sparse MoE block (router module, experts with gate and up fused in one stacked
    parameter, a grouped-matrix kernel of the library's own) is one `moe` op; nothing runs replicated,
    and the module's parameters map to the IR's and back exactly (gate and up: halves of gate_up_proj)."""
    import torch

    from fivedc.ir.aten_call import whole_dims
    from fivedc.frontends.python_file import traced_from_spec
    from fivedc.ir.graph import Op, walk_ops

    module, _, tm = traced_from_spec(f"examples/hf_models.py:{arch}")
    ops = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op)]
    moe = [op for op in ops if op.kind == "moe"]
    assert len(moe) == 2 and not [op for op in ops if op.kind == "aten" and whole_dims(op) is None]
    assert dict(moe[0].attrs)["normalize"] is (arch == "mixtral")  # Qwen3-MoE's norm_topk_prob is off
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    ir = tm.to_ir_params(state)
    gate_up = state["model.model.layers.1.mlp.experts.gate_up_proj"]  # [experts, 2 ffn, hidden]
    ffn = gate_up.shape[1] // 2
    assert torch.equal(ir[moe[1].args[2]], gate_up[:, :ffn].transpose(1, 2))
    assert torch.equal(ir[moe[1].args[3]], gate_up[:, ffn:].transpose(1, 2))
    back = tm.from_ir_params(ir)
    assert set(back) == {n for n, _ in module.named_parameters()} and all(torch.equal(back[k], state[k]) for k in back)


def test_an_moe_block_whose_inner_outputs_are_collected_is_traced_through() -> None:
    """With output_router_logits, Mixtral adds its balancing loss from router logits that hooks collect
    inside the block: kept whole the block would drop it, so it is traced through, its ops (the library's
    own grouped-matrix kernel among them) running replicated, and the loss is the module's."""
    import torch

    from fivedc.frontends.fx_module import trace_module
    from fivedc.frontends.python_file import import_file
    from fivedc.frontends.fx.precision import float64_everywhere
    from fivedc.ir.graph import Op, walk_ops
    from test_frontend_fx import run_ir

    module, inputs = import_file("examples/hf_models.py").build("mixtral", output_router_logits=True)
    tm = trace_module(module, inputs)
    targets = {str(op.attr("target")) for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "aten"}
    assert "transformers.grouped_mm_fallback.default" in targets
    assert not [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "moe"]
    loss, _ = run_ir(tm, module, inputs)
    with float64_everywhere(), torch.no_grad():
        expected = module(*inputs)
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())


def test_a_hugging_face_moe_trains_with_expert_parallelism(worker_pool) -> None:
    """Qwen3-MoE with its own loss at ep=2, in float64 (the library's grouped-matrix kernel has no
    float64 CPU kernel: fivedc's float64 mode computes it per group, fivedc/frontends/fx/precision.py)."""
    from fivedc.parallel.check import check_module

    report = check_module("examples/hf_models.py:qwen3_moe", mesh="1x1x1x1x2", steps=2, dtype="fp64",
                          pool=worker_pool)
    assert report.max_error <= 1e-10 and not report.note, report


def test_a_linear_written_as_x_at_w_transposed_is_a_linear() -> None:
    """Falcon's `FalconLinear`: `input @ self.weight.T` (aten.numpy_T, then a matmul) is the IR's
    linear with that weight, split by tp as any other, not a transposed table computed whole; its
    one k/v head, sliced off a fused view that q shares, gets an IR dim of its own."""
    from fivedc.cli.main import load_graph
    from fivedc.ir.graph import Op, walk_ops

    ops = [op for op, _ in walk_ops(load_graph("examples/hf_models.py:falcon").body) if isinstance(op, Op)]
    assert not [op for op in ops if op.kind == "aten" and "numpy_T" in str(op.attr("target"))]
    # its fused QKV split by `fused[..., [-2], :]`: a slice, so nothing runs replicated
    assert not [op.attr("target") for op in ops if op.kind == "aten" and op.attr("rule") == "replicated"]
    assert sum(op.kind == "linear" for op in ops) >= 8  # per layer: fused qkv, dense, two of the MLP
