"""`fivedc.parallelize`: an ordinary nn.Module trained with a plain torch loop under a plan.

The decorated or wrapped nanoGPT and Llama, at drawn small sizes and meshes with
dp, tp (with and without SP) and cp, trained 2 steps by `torch.optim.AdamW` on
gloo workers, match the plain module trained the same way on one process to 1e-10
in loss, gradients (gathered, in the module's names) and parameters. Then the
module's surface: the decorator, state dicts both ways, gradient accumulation and
overlapped buckets, pins by module path (they change the plan; a bad one is an
error), the plan against the DSL twin, and the `file.py:factory` loader's errors.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from fivedc.frontends.python_file import import_file
import torch.nn as nn
import torch.nn.functional as F

import fivedc
from fivedc.plan.diff import canonical_values, diff_plans
from fivedc.errors import FivedcError, MeshError, NotSupportedError, ShardingError
from fivedc.frontends.dsl_file import load_model
from fivedc.frontends.python_file import graph_from_spec, is_spec, load_factory
from fivedc.ir.graph import Repeat
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.parallel.check import check_module, compare, train_module
from fivedc.parallel.module import ParallelModule
from fivedc.parallel.parallelize import compile_module
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.passes.chunk_params import chunk_param_names

HERE = str(Path(__file__).resolve())
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOL = 1e-10


def _load(name: str):
    """The example `examples/<name>.py` as a module."""
    return import_file(EXAMPLES / f"{name}.py")


nanogpt, llama = _load("nanogpt"), _load("llama")


# ---- drawn models (module-level: the workers build them from `HERE:make_model`) ----------
def make_model(*, kind: str, seed: int, dp: int = 1, tp: int = 1, cp: int = 1, sp: bool = False, fp32: bool = False,
               pp: int = 1):
    """A small nanoGPT or Llama whose sizes divide by the mesh: heads, ffn and vocab by tp,
    the batch by dp, the sequence by 2 cp (balanced layout), and by cp x tp under SP;
    under pp, 2 pp layers and a batch of 2 pp microbatches per dp rank."""
    dtype = torch.float32 if fp32 else torch.float64
    rng = random.Random(seed)
    seq = 2 * cp * (tp if sp else 1) * rng.choice([1, 2])
    batch = dp * rng.choice([1, 2]) * (2 * pp if pp > 1 else 1)
    if kind == "nanogpt":
        heads = tp * rng.choice([1, 2]) if tp > 1 else rng.choice([1, 2, 4])
        config = nanogpt.GPTConfig(block_size=seq, vocab_size=tp * rng.choice([8, 20]), n_layer=rng.choice([1, 2, 3]) if pp == 1 else 2 * pp,
                                   n_head=heads, n_embd=heads * rng.choice([4, 8]))
        return nanogpt.factory(batch=batch, config=config, seed=seed, dtype=dtype)
    kv = tp * rng.choice([1, 2]) if tp == 1 else tp
    heads = kv * (2 if kv == 1 else rng.choice([1, 2]))
    args = llama.ModelArgs(dim=heads * rng.choice([4, 8]), n_layers=rng.choice([1, 2]) if pp == 1 else 2 * pp, n_heads=heads, n_kv_heads=kv,
                           vocab_size=tp * rng.choice([8, 20]), ffn_dim=tp * rng.choice([6, 10]), max_seq_len=seq,
                           rope_theta=rng.choice([10000.0, 500.0]))
    return llama.factory(batch=batch, args=args, seed=seed, dtype=dtype)


CASES = [  # (model, mesh, options): every landed axis, alone and combined, world <= 8
    ("nanogpt", "2x1x2x1x1", {"sequence_parallel": True}),
    ("nanogpt", "1x1x2x2x1", {"sequence_parallel": False}),
    ("nanogpt", "2x1x1x2x1", {"cp_attention": "allgather", "shardings": {"transformer.h.*.mlp.*": "replicate"}}),
    ("llama", "1x1x2x1x1", {"sequence_parallel": False}),
    ("llama", "2x1x2x2x1", {"sequence_parallel": True}),
    ("llama", "4x1x1x1x1", {"overlap": False}),
    ("nanogpt", "2x1x2x1x1", {"zero": 1, "sequence_parallel": True}),
    ("llama", "4x1x1x1x1", {"zero": 2}),
    ("llama", "2x1x1x2x1", {"zero": 3}),
    ("nanogpt", "2x2x1x1x1", {"schedule": "interleaved", "zero": 1}),
    ("llama", "1x2x2x1x1", {"schedule": "dualpipev", "zero": 3, "sequence_parallel": True}),
    ("nanogpt", "1x4x2x1x1", {"schedule": "zb-h1", "zero": 2}),
    ("llama", "2x2x1x1x1", {"schedule": "gpipe", "overlap": False}),
    ("nanogpt", "1x2x1x1x1", {"stage_boundaries": ("transformer.h.1",)}),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}-{m}" for k, m, _ in CASES])
def test_parallelized_module_trains_like_the_plain_module(case: int, worker_pool) -> None:
    kind, mesh, options = CASES[case]
    sizes = dict(zip(("dp", "pp", "tp", "cp"), map(int, mesh.split("x"))))
    kwargs = {"kind": kind, "seed": case, "dp": sizes["dp"], "tp": sizes["tp"], "cp": sizes["cp"],
              "sp": bool(options.get("sequence_parallel")), "pp": sizes["pp"]}
    report = check_module(f"{HERE}:make_model", kwargs=kwargs, mesh=mesh, pool=worker_pool, **options)
    assert report.max_error <= TOL, (kwargs, report)
    assert report.losses[1] != report.losses[0]


def test_the_check_sees_a_gradient_that_is_not_summed(worker_pool) -> None:
    """The comparison is not vacuous: without the gradient sum over dp it fails."""
    module, inputs = make_model(kind="nanogpt", seed=3, dp=2)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    reference = train_module(module, inputs)
    payload = (f"{HERE}:make_model", {"kind": "nanogpt", "seed": 3, "dp": 2}, None, state, inputs,
               {"mesh": "2x1x1x1x1"}, {"steps": 2, "lr": 1e-2, "weight_decay": 0.1})
    broken = compare(reference, worker_pool.run(unsynced_job, world=2, payload=payload)[0])
    assert abs(broken.parallel_losses[0] - broken.losses[0]) < 1e-12 and broken.grad_error > 1e-3


def unsynced_job(info, payload):
    from fivedc.parallel import grads as parallel_grads
    from fivedc.parallel.check import rank_job

    original = parallel_grads.GradSync.__init__
    parallel_grads.GradSync.__init__ = lambda self, *args: None  # no hooks: gradients stay per-rank summands
    try:
        return rank_job(info, payload)
    finally:
        parallel_grads.GradSync.__init__ = original


def launched_job(info, payload):
    """Inside a torch.distributed job (as under torchrun), check_module runs as one of its ranks."""
    return check_module(f"{HERE}:make_model", kwargs={"kind": "nanogpt", "seed": 4, "dp": 2, "fp32": True},
                        mesh="2x1x1x1x1", dtype="fp64")


def test_check_module_as_ranks_of_a_launched_job_casts_to_the_dtype_asked(worker_pool) -> None:
    first, second = worker_pool.run(launched_job, world=2, payload=None)
    assert second is None and first.world == 2
    assert first.max_error <= TOL, first  # an fp32 module checked in fp64: cast on both sides


# ---- the decorator, state dicts, accumulation, overlap -------------------------------------
@fivedc.parallelize(mesh="2x1x2x1x1", sequence_parallel=True)
class DecoratedGPT(nanogpt.GPT):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.double()

    def example_inputs(self):
        gen = torch.Generator().manual_seed(7)
        shape = (4, self.config.block_size)
        return (torch.randint(0, self.config.vocab_size, shape, generator=gen),
                torch.randint(0, self.config.vocab_size, shape, generator=gen))


def features_job(info, payload) -> dict:
    torch.manual_seed(info.rank)  # different weights on every rank: parallelize starts from rank 0's
    model = DecoratedGPT(nanogpt.GPTConfig())
    out = {"type": type(model).__name__, "plan": model.fivedc_plan}
    torch.manual_seed(0)
    plain = DecoratedGPT.fivedc_plain(nanogpt.GPTConfig())
    start = model.full_state_dict()
    out["rank0_start"] = all(torch.equal(start[k], v) for k, v in plain.state_dict().items())
    state = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}  # the same on every rank
    model.load_state_dict(state)  # the full state dict, in the module's keys
    full = model.full_state_dict()
    out["full_round_trip"] = list(full) == list(state) and all(torch.equal(full[k], state[k]) for k in state)
    fused, n = state["transformer.h.0.attn.c_attn.weight"], plain.config.n_embd
    tp = model._fivedc_ctx.coords[MeshAxis.TP]
    blocks = [fused[i * n + tp * n // 2:i * n + (tp + 1) * n // 2] for i in range(3)]  # this rank's q, k, v rows
    out["fused_qkv"] = torch.equal(model.state_dict()["transformer.h.0.attn.c_attn.weight"], torch.cat(blocks))
    again = DecoratedGPT(nanogpt.GPTConfig())
    again.load_state_dict(model.state_dict())  # this rank's shards, in the module's keys too
    out["sharded_round_trip"] = all(torch.equal(v, state[k]) for k, v in again.full_state_dict().items())
    out["local_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    x, y = plain.example_inputs()
    grads = []
    for _ in range(2):  # one step each, then both accumulated
        model.zero_grad()
        model(x, y).backward()
        grads.append(model.full_grads())
    model.zero_grad()
    model(x, y).backward()
    model(x, y).backward()
    both = model.full_grads()
    out["accumulated"] = max((both[k] - grads[0][k] - grads[1][k]).abs().max().item() for k in both)
    out["buckets_started_in_backward"] = model._fivedc_grads.reducer.started_early
    try:
        model(x[:, :4], y[:, :4])
    except FivedcError as error:
        out["shape_error"] = error.render()
    plain.transformer.wte.weight.requires_grad_(False)  # frozen: no gradient, no hook, no bucket
    frozen = fivedc.parallelize(plain, mesh="2x1x2x1x1", example_inputs=(x, y))
    frozen(x, y).backward()
    out["frozen"] = {n: p.grad is not None for n, p in frozen.named_parameters()
                     if n.endswith(("wte.weight", "wpe.weight"))}
    return out if info.rank == 0 else {}


def test_decorated_class_state_dicts_accumulation_and_overlap(worker_pool) -> None:
    out = worker_pool.run(features_job, world=4, payload=None)[0]
    assert out["type"] == "ParallelModule"
    assert out["rank0_start"] and out["full_round_trip"] and out["sharded_round_trip"] and out["fused_qkv"]
    config = nanogpt.GPTConfig()
    shapes = out["local_shapes"]  # the module's keys and layouts: nn.Linear's weight [out, in]
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (4 * config.n_embd // 2, config.n_embd)  # column over tp=2
    assert shapes["transformer.wte.weight"] == (config.vocab_size // 2, config.n_embd)  # vocab-parallel
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (3 * config.n_embd // 2, config.n_embd)  # q, k, v rows
    assert out["accumulated"] <= 1e-12
    assert out["buckets_started_in_backward"] > 0
    assert out["frozen"] == {"transformer.wte.weight": False, "transformer.wpe.weight": True}
    assert "traced with idx of shape (4, 8), got (4, 4)" in out["shape_error"]
    module = DecoratedGPT.fivedc_plain(config)
    mesh = Mesh.parse("2x1x2x1x1")
    _, expected = compile_module(module, module.example_inputs(), mesh=mesh, sequence_parallel=True)
    assert out["plan"] == expected


def pipeline_zero_job(info, payload) -> dict:
    """Llama under pp=2 x dp=2 with ZeRO-1, cut before layer 3: what a rank holds,
    evaluation, a scaled loss, accumulation and the full state dict."""
    module, inputs = make_model(kind="llama", seed=11, dp=2, pp=2)
    model = fivedc.parallelize(module, mesh="2x2x1x1x1", example_inputs=inputs, zero=1, device=info.device,
                               stage_boundaries=("layers.3",))
    plan, out = model.fivedc_plan, {}
    out["chunks"] = [c.what for c in plan.pipeline.chunks]
    pp_rank = model._fivedc_ctx.coords[MeshAxis.PP]
    sizes = {m.key: math.prod(m.key_shape) for m in model.fivedc_traced.params}
    mine = chunk_param_names(plan.graph, plan.pipeline, pp_rank=pp_rank)
    held = dict(model.named_parameters())
    out["holds_its_chunks"] = set(held) == {m.key for m in model.fivedc_traced.params if m.ir_name in mine}
    out["flat_halves"] = all(p.shape == (math.ceil(sizes[n] / 2),) for n, p in held.items())
    with torch.no_grad():
        evaluated = model(*inputs)
    loss = model(*inputs)
    out["eval_error"] = abs(evaluated.item() - loss.item())
    (loss * 0.5).backward()
    half = model.full_grads()
    model.zero_grad()
    model(*inputs).backward()
    once = model.full_grads()
    model(*inputs).backward()
    twice = model.full_grads()
    out["scaled_error"] = max((2 * half[k] - once[k]).abs().max().item() for k in once)
    out["accumulated_error"] = max((twice[k] - 2 * once[k]).abs().max().item() for k in once)
    plain, _ = make_model(kind="llama", seed=11, dp=2, pp=2)
    plain(*inputs).backward()
    out["grad_error"] = max((once[n] - p.grad).abs().max().item() for n, p in plain.named_parameters())
    torch.manual_seed(1)
    state = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    model.load_state_dict(state)
    full = model.full_state_dict()
    out["full_round_trip"] = list(full) == list(state) and all(torch.equal(full[k], state[k]) for k in state)
    return out


def test_a_pipeline_with_zero_holds_its_chunks_and_keeps_torch_semantics(worker_pool) -> None:
    outs = worker_pool.run(pipeline_zero_job, world=4, payload=None)
    for out in outs:
        assert out["chunks"][1].startswith("layers.3"), out["chunks"]
        assert out["holds_its_chunks"] and out["flat_halves"] and out["full_round_trip"], out
        assert out["eval_error"] <= 1e-12 and out["grad_error"] <= 1e-12, out
        assert out["scaled_error"] <= 1e-12 and out["accumulated_error"] <= 1e-12, out


def sp_pipeline_job(info, payload) -> tuple[list, list]:
    """One forward and backward of a parallelized Llama at pp 2 x tp 2 with sequence
    parallelism: what this rank calls over tp, and what the plan's proof says its class calls."""
    from fivedc.instructions.comm_program import class_programs
    from wire_log import Recording, expected_calls

    module, inputs = make_model(kind="llama", seed=3, tp=2, pp=2, sp=True)
    model = fivedc.parallelize(module, mesh="1x2x2x1x1", example_inputs=inputs, sequence_parallel=True,
                               overlap=payload, device=info.device)
    plan = model.fivedc_plan
    recording = Recording(plan.mesh, info).start()
    try:
        model(*inputs).backward()
    finally:
        recording.stop()
    want = expected_calls(class_programs(plan)[model._fivedc_ctx.coords[MeshAxis.PP]])
    return [c for c in recording.calls if c[1] == ("tp",)], [c for c in want if c[1] == ("tp",)]


def test_a_pipelined_module_under_sp_issues_what_the_plan_proves(worker_pool) -> None:
    """The decorator's pipeline runs in the saving scope as `fivedc train` does: SP's gathered
    linear inputs are kept as their shard and gathered again in backward, the plan's
    all-gathers, call for call over tp."""
    from wire_log import same_call

    for overlap in (True, False):  # the linears' dW put off behind the sums, or not
        for got, want in worker_pool.run(sp_pipeline_job, world=4, payload=overlap):
            assert any(c[0] == "all_gather" for c in want)
            assert len(got) == len(want) and all(map(same_call, got, want)), (overlap, got, want)


class OldStyle(nn.Module):
    """`super(OldStyle, self)`: still works once the name is bound to the decorated class."""

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super(OldStyle, self).__init__()
        self.emb, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)
        self.double()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(idx)).view(-1, self.head.out_features), targets.view(-1))


def test_decorator_on_one_rank_without_a_process_group() -> None:
    tokens = (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    decorated = fivedc.parallelize(mesh="1x1x1x1x1", example_inputs=lambda module: tokens)(OldStyle)
    torch.manual_seed(0)
    model = decorated(16, hidden=8)
    torch.manual_seed(0)
    plain = decorated.fivedc_plain(16, hidden=8)
    assert isinstance(model, ParallelModule) and isinstance(plain, OldStyle) and type(plain).__name__ == "OldStyle"
    report = compare(train_module(plain, tokens), train_module(model, tokens))
    assert report.max_error <= 1e-12, report


@pytest.mark.parametrize("kind", ["nanogpt", "llama"])
def test_one_rank_mesh_is_exactly_the_plain_module(kind: str) -> None:
    module, inputs = make_model(kind=kind, seed=5)
    plain, _ = make_model(kind=kind, seed=5)
    model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs)
    report = compare(train_module(plain, inputs), train_module(model, inputs))
    assert report.max_error <= 1e-12, report
    assert not model.fivedc_plan.collectives or all(not c.axes for c in model.fivedc_plan.collectives)


# ---- plans and pins --------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x2x2x1"])
def test_the_plan_of_the_traced_nanogpt_is_the_plan_of_its_dsl_twin(mesh: str, tmp_path) -> None:
    module, inputs = nanogpt.factory()
    traced, plan = compile_module(module, inputs, mesh=Mesh.parse(mesh), sequence_parallel=True)
    options = CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True, dtype=plan.dtype)
    written = compile_graph(canonical_values(load_model(EXAMPLES / "nanogpt.5d")), options)
    ours = compile_graph(canonical_values(traced.graph), options)
    d = diff_plans(ours, written)
    assert d.is_empty and not d.params and not d.collectives, d.to_json()
    plan.save(tmp_path / "plan.json")  # saveable, and diffable against itself once read back
    assert diff_plans(plan, ExecutionPlan.load(tmp_path / "plan.json")).is_empty


def _param_shardings(plan) -> dict[str, str]:
    return {f"{r.name}.{p.name}" if r else p.name: str(p.sharding) for p, r in _walk_params(plan.graph)}


def _walk_params(graph):
    from fivedc.ir.graph import walk_params

    return walk_params(graph.body)


def test_a_pin_by_module_path_changes_the_plan() -> None:
    module, inputs = nanogpt.factory()
    mesh = Mesh.parse("1x1x2x1x1")
    _, default = compile_module(module, inputs, mesh=mesh)
    _, pinned = compile_module(module, inputs, mesh=mesh, shardings={"transformer.h.*.mlp.*": "@replicate"})
    before, after = _param_shardings(default), _param_shardings(pinned)
    assert before["layers.c_fc"] == "ffn:tp" and before["layers.mlp_c_proj"] == "ffn:tp"
    assert after["layers.c_fc"] == after["layers.mlp_c_proj"] == "replicated"
    assert {k: v for k, v in after.items() if "mlp_c_proj" not in k and "c_fc" not in k} == \
        {k: v for k, v in before.items() if "mlp_c_proj" not in k and "c_fc" not in k}  # the rest is as before
    d = diff_plans(default, pinned)
    assert d.params and d.collectives
    mlp = [op for op in next(i for i in pinned.graph.body.items if isinstance(i, Repeat)).body.items
           if getattr(op, "annotations", ())]
    assert {str(a) for op in mlp for a in op.annotations if a.kind == "replicate"} == {"@replicate"}
    assert all(op.loc and op.loc.file.endswith("nanogpt.py") for op in mlp if op.annotation("replicate"))


@pytest.mark.parametrize("pins,message,hint", [
    ({"transformer.h.*.attn.qkv": "col"}, "matches no module with parameters", "transformer.h.*.attn.c_attn"),
    ({"transformer.h.*.attn.c_attn.weight": "col"}, "matches no module", "drop the .weight"),
    ({"transformer.h.0.mlp.c_fc": "replicate"}, "matches 1 of the 2 layers", "'transformer.h.*.mlp.c_fc'"),
    ({"transformer.h.*.ln_1": "replicate"}, "no linear or embedding uses", "norms"),
    ({"lm_head": "sideways"}, "is not a mode", "'col', 'row', 'replicate'"),
    ({"transformer.h.*.mlp.c_fc": "col", "transformer.h.*.mlp.*": "row"}, "pins disagree", "one mode"),
])
def test_bad_pins_are_clear_errors(pins, message: str, hint: str) -> None:
    module, inputs = nanogpt.factory()
    with pytest.raises(ShardingError, match="sharding pin") as info:
        compile_module(module, inputs, mesh=Mesh.parse("1x1x2x1x1"), shardings=pins)
    assert message in info.value.message and hint in info.value.hint + info.value.message


def test_stage_boundaries_cut_the_pipeline_where_they_say() -> None:
    module, inputs = make_model(kind="nanogpt", seed=1, pp=2)
    _, plan = compile_module(module, inputs, mesh=Mesh.parse("1x2x1x1x1"), stage_boundaries=("transformer.h.3",))
    assert plan.pipeline.cut == "marks" and plan.pipeline.chunks[1].what.startswith("layers.3")


def test_misuse_is_a_clear_error() -> None:
    module, inputs = nanogpt.factory()
    with pytest.raises(MeshError, match="no process group is initialised") as info:
        fivedc.parallelize(module, mesh="2x1x2x1x1", example_inputs=inputs)
    assert "torchrun --nproc-per-node=4" in info.value.hint
    with pytest.raises(FivedcError, match="microbatches"):
        compile_module(module, inputs, mesh=Mesh.parse("1x2x1x1x1"), microbatches=3)
    with pytest.raises(FivedcError, match="needs example inputs") as info:
        fivedc.parallelize(module, mesh="1x1x1x1x1")
    assert "GPT.example_inputs(self)" in info.value.hint
    with pytest.raises(FivedcError, match="vocab=64 is not divisible by tp=3"):
        compile_module(module, inputs, mesh=Mesh.parse("1x1x3x1x1"))
    with pytest.raises(FivedcError, match="no option sequence_paralel=") as info:
        fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs, sequence_paralel=True)
    assert info.value.hint == "did you mean sequence_parallel=?"


def test_help_says_what_to_do_and_the_module_prints_its_rank() -> None:
    """A short signature; the docstring says forward returns the loss, a process group must
    exist and how the result is called; `print(model)` names the rank's coordinates plainly."""
    import inspect

    doc = " ".join(fivedc.parallelize.__doc__.split())
    assert len(f"parallelize{inspect.signature(fivedc.parallelize)}") <= 120
    for words in ("forward` must return the loss", "init_process_group", "torchrun",
                  "returns the full loss", "loss.backward()", "model.parameters()"):
        assert words in doc, words
    module, inputs = nanogpt.factory()
    text = repr(fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs))
    assert "GPT, mesh 1x1x1x1x1, this rank at dp=0 pp=0 tp=0 cp=0 ep=0" in text and "MeshAxis" not in text


# ---- file.py:factory -------------------------------------------------------------------------
def test_graph_from_spec_traces_the_examples() -> None:
    for name in ("nanogpt", "llama"):
        graph = graph_from_spec(f"{EXAMPLES / name}.py:factory")
        assert [i.name for i in graph.inputs][1] == "targets" and any(isinstance(i, Repeat) for i in graph.body.items)
    module, inputs = load_factory(str(EXAMPLES / "nanogpt.py"))  # `:factory` is the default
    assert type(module).__name__ == "GPT" and len(inputs) == 2
    assert is_spec("examples/nanogpt.py:factory") and is_spec("model.py") and not is_spec("examples/gpt.5d")


BAD_FACTORIES = {
    "returns_one": ("def factory():\n    return 3\n", "must return (module, example_inputs), got int", 1),
    "not_module": ("def factory():\n    return 3, (1,)\n", "returned int where an nn.Module belongs", 1),
    "raises": ("import torch\n\ndef factory():\n    return torch.zeros(2) @ torch.zeros(3)\n", "factory() failed", 4),
    "import_fails": ("x = 1\nraise ValueError('no config')\n", "importing", 2),
    "syntax": ("def factory(:\n    pass\n", "does not parse", 1),
}


@pytest.mark.parametrize("name", list(BAD_FACTORIES))
def test_bad_factories_name_the_users_line(name: str, tmp_path) -> None:
    text, message, line = BAD_FACTORIES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    with pytest.raises(FivedcError) as info:
        load_factory(f"{path}:factory")
    assert message in info.value.message and "Traceback" not in info.value.render()
    assert info.value.loc is not None and info.value.loc.file.endswith(f"{name}.py") and info.value.loc.line == line


def test_a_missing_file_or_function(tmp_path) -> None:
    with pytest.raises(FivedcError, match="does not exist"):
        load_factory(f"{tmp_path}/nope.py:factory")
    (tmp_path / "m.py").write_text("def make_model():\n    pass\n\ndef helper():\n    pass\n")
    with pytest.raises(FivedcError, match="has no function 'make_modle'") as info:
        load_factory(f"{tmp_path}/m.py:make_modle")
    assert "did you mean make_model" in info.value.hint


def test_a_model_that_does_not_trace_is_an_error_at_its_line(tmp_path) -> None:
    path = tmp_path / "loop_model.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)\n\n"
        "    def forward(self, idx, targets):\n"
        "        h = self.emb(idx) * int(idx.max())\n"
        "        return F.cross_entropy(self.head(h).view(-1, 16), targets.view(-1))\n\n"
        "def factory():\n    return M(), (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))\n"
    )
    with pytest.raises(NotSupportedError, match="cannot trace") as info:
        graph_from_spec(f"{path}:factory")
    assert info.value.loc.file == str(path) and info.value.loc.line == 11


class Scaled(OldStyle):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return super().forward(idx, targets) * scale


def test_arguments_fixed_by_the_trace_are_checked_on_every_call() -> None:
    tokens = (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    model = fivedc.parallelize(Scaled(), mesh="1x1x1x1x1", example_inputs=(*tokens, 2.0))
    model(*tokens, 2.0)
    model(*tokens, scale=2.0)
    with pytest.raises(FivedcError, match=r"was traced with scale=2.0, got 3.0"):
        model(*tokens, 3.0)
    with pytest.raises(FivedcError, match="wrong arguments"):
        model(tokens[0])


class SavedSplit(nn.Module):
    """One `wqkv` parameter that its state dict writes as `wq`, `wk` and `wv` (a state-dict
    post-hook, as torchtitan's FusedQKVLinear does for its checkpoints)."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.randn(3 * hidden, hidden, dtype=torch.float64) / hidden ** 0.5)
        self.register_state_dict_post_hook(_split_on_save)

    def forward(self, x, y):
        q, k, v = F.linear(x, self.wqkv).chunk(3, dim=-1)
        return F.mse_loss(torch.tanh(q) * k + v, y)


def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
    wq, wk, wv = state_dict.pop(f"{prefix}wqkv").chunk(3)
    state_dict.update({f"{prefix}wq": wq, f"{prefix}wk": wk, f"{prefix}wv": wv})


def test_a_module_whose_state_dict_renames_its_parameters_trains_like_the_plain_module() -> None:
    torch.manual_seed(0)
    module, x, y = SavedSplit(), torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    plain = SavedSplit()
    plain.load_state_dict({"wqkv": module.wqkv.detach().clone()}, strict=False)
    assert "wqkv" not in module.state_dict()  # the parameters are read by their own names, not the state dict's
    model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=(x, y))
    report = compare(train_module(plain, (x, y)), train_module(model, (x, y)))
    assert report.max_error <= 1e-12, report
