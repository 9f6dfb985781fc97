"""Faults: a rank that dies ends the training job at once, naming it; resuming loses at most the save interval.

The job function lives at module level (the pool pickles it by reference). Rank 1's
process exits as it reads the batch of step 3, after the checkpoint of step 2 was
committed; the pool sees the dead process by its sentinel, long before any
collective timeout. Also: `fivedc train` as one rank of a launcher (torchrun's
environment, a world of one, in this process) with the `--` that keeps torchrun's
own parser off the command's flags.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from fivedc.cli.main import main
from fivedc.log_file import rows_of
from fivedc.runtime.checkpoint import committed, find_checkpoint, read_index
from fivedc.runtime.data import RankBatches
from fivedc.runtime.pool import WorkerError
from fivedc.runtime.reshard import consolidate
from fivedc.runtime.train_loop import train_job
from train_helpers import job_for, make_tokens, one_device, plan_of

CONFIG = dict(steps=5, lr=1e-2, save_every=2, seed=3)


def die_on_rank_one(info, job):
    """`train_job`, except that rank 1's process exits as it reads the batch of step 3."""
    if info.rank != 1:
        return train_job(info, job)
    real = RankBatches.at

    def at(self, step, rows=None):
        if step == 2 and self.sampler.shuffle:  # the training file's (validation reads in order)
            os._exit(9)
        return real(self, step, rows)

    RankBatches.at = at
    try:
        return train_job(info, job)
    finally:
        RankBatches.at = real


def test_a_dead_rank_ends_the_job_and_resuming_loses_at_most_the_interval(worker_pool, tmp_path) -> None:
    data = make_tokens(tmp_path)
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "2x1x1x1x1"), data, **CONFIG), save_dir=str(tmp_path / "a"))
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        worker_pool.run(die_on_rank_one, world=2, payload=job)
    assert time.monotonic() - start < worker_pool.timeout_s
    error = caught.value
    assert (error.rank, error.exit_code) == (1, 3) and "rank 1 of 2 failed" in str(error) and "died" in str(error)
    assert [step for step, _ in committed(tmp_path / "a")] == [2]  # one step lost: the interval is 2
    one = plan_of("tiny_llama", "1x1x1x1x1")
    whole = dataclasses.replace(job, plan=one, save_dir=str(tmp_path / "whole"))
    one_device(whole)
    one_device(dataclasses.replace(whole, save_dir=str(tmp_path / "b"), resume=str(find_checkpoint(tmp_path / "a"))))
    want, got = (consolidate(p / "step-00000005", read_index(p / "step-00000005")) for p in (tmp_path / "whole",
                                                                                          tmp_path / "b"))
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 1e-12 * want[name].abs().max(), name


def other_weights_on_rank_one(info, job):
    """`train_job` where rank 1's module came out with other weights (an unseeded factory)."""
    if info.rank == 1:
        job = dataclasses.replace(job, init={name: t + 1.0 for name, t in job.init.items()})
    return train_job(info, job)


def test_launched_ranks_start_from_rank_zeros_weights(worker_pool, tmp_path) -> None:
    """Under a launcher every rank traces the module itself: rank 0's weights are broadcast."""
    from fivedc.runtime.program import init_params

    plan = plan_of("tiny_llama", "2x1x1x1x1")
    job = dataclasses.replace(job_for(plan, make_tokens(tmp_path), steps=2, lr=1e-2),
                              init=init_params(plan.graph, seed=9, dtype=torch.float64))
    rows = worker_pool.run(other_weights_on_rank_one, world=2, payload=job)[0]["rows"]
    want = one_device(dataclasses.replace(job, plan=plan_of("tiny_llama", "1x1x1x1x1")))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=1e-12)


def test_train_runs_as_one_rank_of_a_launcher(tmp_path, monkeypatch, capsys) -> None:
    data = make_tokens(tmp_path)
    with socket.socket() as probe:  # a free port for the env:// rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["--", "train", "examples/tiny_llama.5d", "--mesh", "1x1x1x1x1", "--data", data[0], "--steps", "2",
                     "--log", str(tmp_path / "run.jsonl"), "--save-dir", str(tmp_path / "ck")])
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert code == 0 and not dist.is_initialized()
    assert "step 2/2" in capsys.readouterr().out
    assert [row["step"] for row in rows_of(tmp_path / "run.jsonl")] == [1, 2]
    assert [step for step, _ in committed(tmp_path / "ck")] == [2]
