"""`fivedc train`: token files, the sampler, the schedule, clipping by the global norm, the command.

The data and schedule tests need no processes: a rank's batch is checked against
`program.shard` of the global batch read straight from the file, the learning
rate against torch's own schedulers. Clipping is checked in float64 on the shared
worker pool: the global norm of a parallel run (TP, PP, ZeRO-3 chunks; EP and CP)
equals the single-device run's at every step, which equals torch's
`clip_grad_norm_` on the plain gradients, and the clipped runs keep the same losses.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fivedc.cli.main import main
from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import parse_model
from fivedc.runtime.data import RankBatches, Sampler, TokenFile, input_roles, read_windows
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program, init_params, shard
from fivedc.runtime.train_loop import train_job
from fivedc.runtime.train_config import TrainConfig
from train_helpers import job_for, make_tokens, one_device, plan_of, rel

TOL = 1e-12


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    return make_tokens(tmp_path_factory.mktemp("tokens"))


def test_sampler_is_a_pure_function_of_the_step() -> None:
    sampler = Sampler(tokens=1001, seq=10, batch=3, seed=5)
    assert (sampler.windows, sampler.steps_per_epoch) == (100, 33)
    epoch = np.concatenate([sampler.rows(k) for k in range(33)])
    assert len(set(epoch.tolist())) == 99  # one epoch: no window twice, the last one left out
    again = Sampler(tokens=1001, seq=10, batch=3, seed=5)
    for step in (40, 0, 77, 33, 5):  # any order: nothing but the step decides
        assert again.rows(step).tolist() == sampler.rows(step).tolist()
    assert sampler.rows(33).tolist() != sampler.rows(0).tolist()  # a new epoch, a new order
    assert Sampler(tokens=1001, seq=10, batch=3, seed=6).rows(0).tolist() != sampler.rows(0).tolist()
    file = np.arange(1001, dtype=np.uint16)
    assert read_windows(file, np.array([2, 0]), 10).tolist() == [list(range(20, 31)), list(range(0, 11))]


@pytest.mark.parametrize("mesh", ["2x1x1x2x1", "1x1x2x2x1"])
def test_each_rank_reads_its_shard_of_the_global_batch(data, mesh: str) -> None:
    """dp ranks read their own rows, cp ranks their part of the sequence in the balanced
    layout: exactly `shard` of the global batch, which is windows of the file."""
    plan = plan_of("tiny_llama", mesh)
    graph, batch, seq = plan.graph, 4, 8
    sampler = Sampler(tokens=3000, seq=seq, batch=batch, seed=1)
    array = TokenFile(data[0]).array()
    for step in (0, 9):
        windows = torch.tensor(np.stack([array[r * seq:r * seq + seq + 1] for r in sampler.rows(step)]),
                               dtype=torch.int64)
        full = {"tokens": windows[:, :-1], "targets": windows[:, 1:]}
        for rank in range(plan.mesh.world):
            ctx = KernelContext(graph, plan.mesh, plan.mesh.coords(rank))
            local = RankBatches(TokenFile(data[0]), sampler, graph, ctx, torch.device("cpu")).at(step)
            for item in graph.inputs:
                assert torch.equal(local[item.name], shard(full[item.name], item.type.dims, item.sharding, ctx))


def test_learning_rate_is_warmup_then_cosine_as_torch_schedules_it() -> None:
    config = TrainConfig(steps=30, lr=3e-3, min_lr=2e-4, warmup=5)
    p = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([p], lr=config.lr)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / 6, end_factor=1.0, total_iters=5),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=30 - 1 - 5, eta_min=2e-4)], milestones=[5])
    for step in range(30):
        assert rel(config.lr_at(step), optimizer.param_groups[0]["lr"]) < 1e-9, step
        optimizer.step()
        schedule.step()
    assert config.lr_at(29) == pytest.approx(2e-4) and TrainConfig(steps=10).floor == pytest.approx(1e-4)


def test_inputs_that_are_not_tokens_are_refused() -> None:
    graph = parse_model("model m { dims { batch = 2 seq = 4 hidden = 8 vocab = 16 }\n"
                        "input x: float[batch, seq, hidden]\n input targets: int[batch, seq]\n"
                        "param w: [hidden, vocab]\n"
                        "loss = cross_entropy(linear(x, w), targets)\n return loss }")
    with pytest.raises(FivedcError, match="feeds token ids, and the model's input x"):
        input_roles(graph)
    assert input_roles(plan_of("tiny_llama", "1x1x1x1x1").graph) == {"tokens": "inputs", "targets": "targets"}


class _Labels(torch.nn.Module):
    """A tiny LM that shifts its labels itself (`shift`), or only masks them."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.shift, self.emb, self.head = shift, torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(idx))
        if self.shift:  # as Hugging Face's causal-LM loss
            labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        else:
            labels = torch.where(labels == 0, -100, labels)  # an ATen op that moves nothing
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1))


@pytest.mark.parametrize("shift,role", [(True, "labels"), (False, "targets")])
def test_labels_the_model_shifts_get_the_tokens_themselves(shift: bool, role: str) -> None:
    from fivedc.frontends.fx_module import trace_module

    ids = torch.randint(0, 32, (2, 8))
    graph = trace_module(_Labels(shift), (ids, ids.clone())).graph  # one tensor passed twice confuses export
    assert input_roles(graph) == {"idx": "inputs", "labels": role}


@pytest.mark.parametrize("case,message", [
    ("missing", "training file {data} does not exist"),
    ("odd", "has 7 bytes, not a whole number of uint16 token ids"),
    ("short", "holds 20 tokens: not one batch of 4 sequences of 8 + 1 tokens"),
    ("vocab", "holds token id 64, and the model's vocabulary has 64 ids"),
    ("steps", "--steps 0 must be a whole number >= 1"),
    ("min-lr", "--min-lr 0.1 is above --lr 0.001"),
    ("save-every", "--save-every 5 needs a place to save"),
    ("save-dir", "not a fivedc checkpoint index"),  # --resume auto reads the latest, step-00000007
    ("resume", "nowhere does not exist"),
])
def test_bad_data_and_settings_are_refused_before_any_process(tmp_path, capsys, case: str, message: str) -> None:
    data = tmp_path / "train.bin"
    contents = {"odd": b"\x01" * 7, "short": np.arange(20, dtype=np.uint16).tobytes(),
                "vocab": np.full(100, 64, dtype=np.uint16).tobytes()}
    if case in contents:
        data.write_bytes(contents[case])
    else:
        np.ones(100, dtype=np.uint16).tofile(data)
    if case == "missing":
        data = tmp_path / "nothing.bin"
    (tmp_path / "ck" / "step-00000007").mkdir(parents=True)
    (tmp_path / "ck" / "step-00000007" / "index.json").write_text("{}")
    flags = {"steps": ["--steps", "0"], "min-lr": ["--min-lr", "0.1"], "save-every": ["--save-every", "5"],
             "save-dir": ["--save-dir", str(tmp_path / "ck")], "resume": ["--resume", str(tmp_path / "nowhere")]
             }.get(case, [])
    code = main(["train", "examples/tiny_llama.5d", "--mesh", "1x1x1x1x1", "--data", str(data), *flags])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and message.format(data=data) in err and "Traceback" not in err


@pytest.mark.parametrize("model,mesh,options", [
    ("tiny_llama", "2x2x2x1x1", {"zero": 1}),  # pp holders; ZeRO-1 chunks over dp, norms over tp
    ("moe", "1x1x1x2x2", {"zero": 2}),  # ep splits the experts, cp the sequence; ZeRO-2 chunks over the rest
])
def test_global_norm_and_clipping_match_one_device(worker_pool, data, model: str, mesh: str, options: dict) -> None:
    config = dict(steps=3, lr=1e-2, clip=0.2, val_every=0, seed=3)  # clip well below the norm: every step clips
    job = job_for(plan_of(model, mesh, **options), data, **config)
    ref_plan = plan_of(model, "1x1x1x1x1")
    ref = one_device(dataclasses.replace(job, plan=ref_plan))
    assert _plain_norm(ref_plan, job) == pytest.approx(ref[0]["grad_norm"], rel=TOL)  # torch's, on one device
    rows = worker_pool.run(train_job, world=job.plan.mesh.world, payload=job)[0]["rows"]
    assert all(r["grad_norm"] > 0.2 for r in ref)
    for got, want in zip(rows, ref, strict=True):
        assert rel(got["grad_norm"], want["grad_norm"]) < TOL and rel(got["loss"], want["loss"]) < TOL
    assert rel(rows[-1]["val_loss"], ref[-1]["val_loss"]) < TOL


def _plain_norm(plan, job) -> float:
    """torch.nn.utils.clip_grad_norm_ over the first step's gradients of the plan's program on one device."""
    graph = plan.graph
    ctx = KernelContext(graph, plan.mesh, plan.mesh.coords(0))
    full = init_params(graph, seed=job.config.seed, dtype=torch.float64)
    params = {n: t.requires_grad_(True) for n, t in full.items()}
    batches = RankBatches(job.train, Sampler(job.train_tokens, 8, graph.dim("batch"), job.config.seed), graph, ctx,
                          torch.device("cpu"))
    Program(graph, ctx).loss(params, batches.at(0)).backward()
    return torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=1e9).item()
