"""Restarts: a job whose rank dies comes back by itself from the latest committed checkpoint.

Under torchrun (`python -m torch.distributed.run --standalone --max-restarts 1`, two local
processes on gloo) `FIVEDC_FAULT` kills rank 1 as step 3 begins on the first attempt: the
restart resumes by `--resume auto` from step 2 and ends at step 4 with the parameters of
one device trained 4 steps without a stop (float64, 1e-10). The local launcher's own
`--max-restarts` (on the shared worker pool) loses rank 1 in the middle of step 4's save
(its shard written, the checkpoint not committed): the half-written step 4 is never read,
the run continues from step 2. `--mesh auto` is tested as one rank of a launcher in this
process: a world of 1 continuing a checkpoint saved by 2 ranks. Each torchrun attempt
starts two Pythons that import torch and compile: the test keeps to two attempts.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fivedc.cli.main import main
from fivedc.runtime.checkpoint import committed, read_index
from fivedc.runtime.reshard import consolidate
from fivedc.runtime.train_loop import train_job
from train_helpers import ROOT, job_for, make_tokens, one_device, plan_of

TOL = 1e-10


def final_params(save_dir, step: int) -> dict[str, torch.Tensor]:
    folder = save_dir / f"step-{step:08d}"
    return consolidate(folder, read_index(folder))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max() <= TOL * want[name].abs().max(), name


def reference(tmp_path, data, *, steps: int, save_every: int) -> dict[str, torch.Tensor]:
    """One device, never stopped, the command's default settings."""
    job = job_for(plan_of("tiny_llama", "1x1x1x1x1"), data, steps=steps, save_every=save_every)
    one_device(dataclasses.replace(job, save_dir=str(tmp_path / "reference")))
    return final_params(tmp_path / "reference", steps)


def test_torchrun_restarts_from_the_latest_checkpoint(tmp_path) -> None:
    data = make_tokens(tmp_path)
    env = {**os.environ, "FIVEDC_FAULT": "1:3",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.1", "-m", "fivedc", "--", "train",
               str(ROOT / "examples" / "tiny_llama.5d"), "--mesh", "2x1x1x1x1", "--dtype", "fp64", "--data", data[0],
               "--val", data[1], "--steps", "4", "--save-every", "2", "--save-dir", "ck"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = " ".join(done.stdout.split())
    assert "rank 1 exits at step 3" in done.stderr and out.count("resuming from") == 1, out
    assert "resuming from ck/step-00000002 at step 2 (--resume auto: the latest committed checkpoint" in out
    # rank 0 says it lost a peer when it notices first; under load torchrun may stop it before
    assert "step 4/4" in out and "internal error" not in done.stderr
    assert [step for step, _ in committed(tmp_path / "ck")] == [2, 4]
    assert_same(final_params(tmp_path / "ck", 4), reference(tmp_path, data, steps=4, save_every=2))


def test_the_local_launcher_restarts_after_a_death_mid_save(worker_pool, tmp_path, monkeypatch, capsys) -> None:
    from fivedc.runtime import pool

    monkeypatch.setattr(pool, "run_once", lambda fn, *, world, payload, on_progress=None, **_: worker_pool.run(
        fn, world=world, payload=payload, on_progress=on_progress))
    monkeypatch.setenv("FIVEDC_FAULT", "1:4:save")
    data = make_tokens(tmp_path)
    code = main(["train", "examples/tiny_llama.5d", "--mesh", "2x1x1x1x1", "--dtype", "fp64", "--data", data[0],
                 "--val", data[1], "--steps", "6", "--save-every", "2", "--save-dir", str(tmp_path / "ck"),
                 "--max-restarts", "1"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert (f"restart 1 of 1: rank 1 of 2 failed in train_job: the worker process died (exit code 9); continuing "
            f"from {tmp_path / 'ck' / 'step-00000002'}") in out
    assert [step for step, _ in committed(tmp_path / "ck")] == [2, 4, 6]
    assert_same(final_params(tmp_path / "ck", 6), reference(tmp_path, data, steps=6, save_every=2))


def test_without_ray_the_launcher_says_how_to_install_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    data = make_tokens(tmp_path)
    code = main(["train", "examples/tiny_llama.5d", "--mesh", "2x1x1x1x1", "--data", data[0], "--steps", "1",
                 "--launcher", "ray"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--launcher ray needs Ray, which is not installed here" in err
    assert 'pip install "fivedc[ray]"' in err and "Traceback" not in err


def test_a_finished_run_found_by_resume_auto_is_done(tmp_path, capsys) -> None:
    """The same command again: the save directory's latest checkpoint is the last step (exit 0)."""
    data = make_tokens(tmp_path)
    job = job_for(plan_of("tiny_llama", "1x1x1x1x1", dtype="fp32"), data, steps=2, save_every=2)
    one_device(dataclasses.replace(job, save_dir=str(tmp_path / "ck")))
    code = main(["train", "examples/tiny_llama.5d", "--mesh", "1x1x1x1x1", "--data", data[0], "--steps", "2",
                 "--save-dir", str(tmp_path / "ck")])
    out = capsys.readouterr().out
    assert code == 0 and "step-00000002 is at step 2: this run is done" in " ".join(out.split())


def launched_rank(monkeypatch, world: int = 1) -> None:
    """This process as rank 0 of a launcher's world (torchrun's variables)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_mesh_auto_reshards_a_checkpoint_to_the_world_it_finds(worker_pool, tmp_path, monkeypatch, capsys) -> None:
    """Saved by 2 ranks (dp2) at step 3; continued by a world of 1 with --mesh auto to step 6."""
    data = make_tokens(tmp_path)
    job = job_for(plan_of("tiny_llama", "2x1x1x1x1"), data, steps=6, save_every=3)
    worker_pool.run(train_job, world=2, payload=dataclasses.replace(job, save_dir=str(tmp_path / "ck"), until=3))
    launched_rank(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["--", "train", "examples/tiny_llama.5d", "--mesh", "auto", "--dtype", "fp64", "--data", data[0],
                     "--val", data[1], "--steps", "6", "--save-dir", str(tmp_path / "ck")])
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "mesh auto: 1 process; the search ranks first, on 1 x h100 (--gpu h100: the default profile): " \
           "--mesh 1x1x1x1x1" in out
    assert "saved on mesh 2x1x1x1x1 (ZeRO 0, fp64), now mesh 1x1x1x1x1" in out
    assert_same(final_params(tmp_path / "ck", 6), reference(tmp_path, data, steps=6, save_every=3))


def test_mesh_auto_is_the_searchs_first_layout(monkeypatch) -> None:
    from fivedc.cli.main import build_parser
    from fivedc.cli.train_plan import train_plan
    from fivedc.frontends.dsl_file import load_model
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import search

    parser = build_parser()
    args = parser.parse_args(["train", "examples/tiny_llama.5d", "--mesh", "auto", "--data", "x.bin"])
    defaults = parser.parse_args(["train", "examples/tiny_llama.5d", "--data", "x.bin"])
    for world in (2, 4):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        plan, module, note = train_plan(args, defaults, launched=True)
        best = search(load_model(str(ROOT / "examples" / "tiny_llama.5d")), gpus=world, hardware=hardware("h100", ()),
                      dtype="fp32", keep=1, compile_best=False).best.candidate
        assert (plan.mesh, plan.zero, module) == (best.mesh, best.zero, None)
        assert note.endswith(best.flags()) and plan.mesh.world == world
    args = parser.parse_args(["train", "examples/tiny_llama.5d", "--mesh", "auto", "--fp8", "--data", "x.bin"])
    plan, _, note = train_plan(args, defaults, launched=True)  # the precision is the user's: searched with it
    best = search(load_model(str(ROOT / "examples" / "tiny_llama.5d")), gpus=4, hardware=hardware("h100", ()),
                  dtype="fp32", keep=1, compile_best=False, fp8=True).best.candidate
    assert plan.fp8 and plan.mesh == best.mesh and note.endswith(best.flags()) and note.endswith("--fp8")


@pytest.mark.parametrize("flags,message", [
    (["--mesh", "auto"], "--mesh auto takes the world a launcher finds"),
    (["--mesh", "2x1x1x1x1", "--max-restarts", "-1"], "--max-restarts -1 must be 0 or more"),
    (["--mesh", "2x1x1x1x1", "--address", "ray://h:10001"], "names a Ray cluster, for --launcher ray"),
])
def test_launch_flags_are_checked_before_any_work(tmp_path, capsys, flags, message) -> None:
    code = main(["train", "examples/tiny_llama.5d", "--data", str(tmp_path / "none.bin"), *flags])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and message in err and "Traceback" not in err


def test_mesh_auto_refuses_the_options_the_search_chooses(tmp_path, monkeypatch, capsys) -> None:
    data = make_tokens(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # a rank that does not print: the error still goes to stderr
    code = main(["train", "examples/tiny_llama.5d", "--mesh", "auto", "--zero", "1", "--data", data[0]])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--mesh auto lets the search choose the layout and its options, and --zero" in err
