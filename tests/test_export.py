"""Training a traced module from its own weights, and exporting it under its own names.

`fivedc train file.py:factory` starts from the module's weights (the first loss is
the module's own on the first batch) and its checkpoints carry the module's names:
`fivedc export` writes one safetensors file that the module (tied weights under
both names) or, with `--strip-prefix`, the Hugging Face model itself loads with
`load_state_dict` or `from_pretrained`; the loaded model's loss on the next batch
is what fivedc computes at the next step after resuming from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from fivedc.cli.main import main
from fivedc.runtime.export import names_of
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.data import RankBatches, Sampler
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.train_loop import TrainJob, train_job
from fivedc.cli.train_launch import _write_init
from train_helpers import ROOT, job_for, make_tokens, one_device

CONFIG = dict(steps=3, lr=1e-2, save_every=0, seed=2)


def batch_at(job: TrainJob, step: int) -> dict[str, torch.Tensor]:
    """The global batch of a step, as one device reads it."""
    graph, plan = job.plan.graph, job.plan
    ctx = KernelContext(graph, plan.mesh, plan.mesh.coords(0))
    seq = graph.dim(graph.inputs[0].type.dims[1])
    sampler = Sampler(job.train_tokens, seq, graph.dim(graph.inputs[0].type.dims[0]), job.config.seed)
    return RankBatches(job.train, sampler, graph, ctx, torch.device("cpu")).at(step)


def test_train_and_export_commands_on_a_traced_module(tmp_path, capsys) -> None:
    """`fivedc train file.py:factory` (tied weights) with validation, checkpoints, --log,
    --plot and progress; `fivedc export`; the module's own load_state_dict."""
    from replicated_models import TiedLM, tied_lm

    data = make_tokens(tmp_path, vocab=32)
    save, log, picture = tmp_path / "run", tmp_path / "run.jsonl", tmp_path / "loss.png"
    log.write_text('{"step": 0, "earlier": true}\n')  # --log appends
    assert main(["train", f"{ROOT}/tests/replicated_models.py:tied_lm", "--mesh", "1x1x1x1x1", "--dtype", "fp64",
                 "--data", data[0], "--val", data[1], "--steps", "6", "--lr", "1e-2", "--seed", "2", "--val-every", "3",
                 "--until", "4", "--save-dir", str(save), "--save-every", "2", "--log", str(log),
                 "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # lines wrap at 100 columns wherever the temporary path puts them
    assert "from step 0 to 4 (of 6)" in words and "idx <- the tokens" in words
    assert "step 4/4 [##########]" in out and "tok/s" in out and "ETA" in out
    assert f"wrote {picture}" in words and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[0] == {"step": 0, "earlier": True} and [r["step"] for r in rows[1:]] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 3, 4]  # saves, --val-every, the last step
    assert [r["step"] for r in rows if "checkpoint" in r] == [2, 4] and rows[4]["tokens"] == 4 * 4 * 8
    assert {"loss", "lr", "grad_norm", "seconds"} <= rows[1].keys()
    module, inputs = tied_lm()
    plan = compile_graph(trace_module(module, inputs).graph, CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype="fp64"))
    job = dataclasses.replace(job_for(plan, data, **dict(CONFIG, steps=6)), resume=str(save / "step-00000004"))
    with torch.no_grad():  # the run started from the factory's own weights
        assert rows[1]["loss"] == pytest.approx(module(batch_at(job, 0)["idx"]).item(), rel=1e-12)
    step5 = one_device(job)[0]
    assert main(["export", str(save), "-o", str(tmp_path / "model.safetensors")]) == 0
    assert "in the module's state_dict names" in capsys.readouterr().out
    exported = load_file(tmp_path / "model.safetensors")
    assert set(exported) == set(dict(module.named_parameters(remove_duplicate=False))) >= {"emb.weight", "head.weight"}
    assert torch.equal(exported["emb.weight"], exported["head.weight"])  # tied: both names
    trained = TiedLM().double()
    trained.load_state_dict(exported, strict=True)
    assert not torch.equal(trained.up.weight, module.up.weight)
    with torch.no_grad():  # the exported weights are the trained ones, each in its place
        assert trained(batch_at(job, 4)["idx"]).item() == pytest.approx(step5["loss"], rel=1e-12)


def test_hugging_face_llama_loads_the_export(worker_pool, tmp_path, capsys) -> None:
    """A Hugging Face Llama trained on tp2 from its own weights, resumed on one device;
    the export, with the wrapper's prefix stripped, loads into LlamaForCausalLM."""
    import transformers
    from fivedc.frontends.python_file import load_factory
    from fivedc.frontends.fx.precision import float64_everywhere

    data, save = make_tokens(tmp_path), tmp_path / "run"
    module, inputs = load_factory(f"{ROOT}/examples/hf_models.py:llama")
    traced = trace_module(module, inputs)
    plans = [compile_graph(traced.graph, CompileOptions(mesh=Mesh.parse(m), dtype="fp64"))
             for m in ("1x1x2x1x1", "1x1x1x1x1")]
    job = dataclasses.replace(job_for(plans[0], data, **CONFIG), save_dir=str(save), until=2,
                              init=_write_init(traced.to_ir_params(module.state_dict()), tmp_path / "init.safetensors"),
                              names=names_of(traced, module))
    rows = worker_pool.run(train_job, world=2, payload=job)[0]["rows"]
    job = dataclasses.replace(job, plan=plans[1], resume=str(save / "step-00000002"), save_dir=None, until=None)
    step3 = one_device(job)[0]
    exported = tmp_path / "hf" / "model.safetensors"
    exported.parent.mkdir()
    assert main(["export", str(save), "-o", str(exported), "--strip-prefix", "model."]) == 0
    hf = transformers.LlamaForCausalLM(module.model.config).double()
    hf.load_state_dict(load_file(exported), strict=True)
    module.model.config.save_pretrained(exported.parent)
    again = transformers.LlamaForCausalLM.from_pretrained(exported.parent, dtype=torch.float64)
    with torch.no_grad(), float64_everywhere(True):  # the library's float32 parts in float64, as fivedc computes
        assert rows[0]["loss"] == pytest.approx(module(**batch_at(job, 0)).item(), rel=1e-10)  # its own weights
        for model in (hf, again):
            loss = model(**batch_at(job, 2), use_cache=False).loss
            assert loss.item() == pytest.approx(step3["loss"], rel=1e-10)
