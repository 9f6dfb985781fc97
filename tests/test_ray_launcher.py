"""`fivedc train --launcher ray`: the issue's acceptance on a local Ray instance the command starts.

One run of `fivedc train examples/tiny_llama.5d --mesh 2x1x1x1x1 --launcher ray ... --steps 20
--save-every 5` with `FIVEDC_FAULT=1:12` (rank 1's actor dies as step 12 begins) and
`--max-restarts 1`: the driver sees the death, kills the group, starts new actors from
step 10's checkpoint and ends at step 20. Its checkpoints (the steps kept, every index
field but the shards' digests, every tensor) are those of the same command on the local
launcher, which runs uninterrupted: the same checkpoints, and the faulted run's final
parameters equal to an uninterrupted run's (float64, 1e-10). Starting Ray and its actors
is the slow part (about 10 s here on an idle machine, 30 s on a busy one): one Ray run
in all. Skipped only where Ray is not installed (`pip install "fivedc[ray]"`).
"""

from __future__ import annotations

import json

import pytest

from fivedc.cli.main import main
from fivedc.runtime.checkpoint import committed, read_index
from fivedc.runtime.reshard import consolidate
from train_helpers import make_tokens

pytest.importorskip("ray", reason='Ray is not installed (pip install "fivedc[ray]")')

TOL = 1e-10


def train(data, save_dir, *more: str) -> list[str]:
    return ["train", "examples/tiny_llama.5d", "--mesh", "2x1x1x1x1", "--dtype", "fp64", "--data", data[0], "--val",
            data[1], "--steps", "20", "--save-every", "5", "--save-dir", str(save_dir), *more]


def test_ray_writes_the_local_launchers_checkpoints_through_a_dead_actor(worker_pool, tmp_path, monkeypatch,
                                                                           capsys) -> None:
    from fivedc.runtime import pool

    monkeypatch.setattr(pool, "run_once", lambda fn, *, world, payload, on_progress=None, **_: worker_pool.run(
        fn, world=world, payload=payload, on_progress=on_progress))
    data = make_tokens(tmp_path)
    assert main(train(data, tmp_path / "local")) == 0
    capsys.readouterr()
    monkeypatch.setenv("FIVEDC_FAULT", "1:12")
    code = main(train(data, tmp_path / "ray", "--launcher", "ray", "--max-restarts", "1"))
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "Ray: 2 actors on a local Ray instance, one CPU (gloo) each, packed (placement group, PACK)" in out
    assert (f"restart 1 of 1: rank 1 of 2 died: its Ray actor's process ended (ActorDiedError); continuing from "
            f"{tmp_path / 'ray' / 'step-00000010'}") in out
    assert out.index("step 11/20") < out.index("restart 1 of 1") < out.rindex("step 11/20")  # streamed as they came
    assert "step 20/20" in out
    steps = [step for step, _ in committed(tmp_path / "local")]
    assert steps == [step for step, _ in committed(tmp_path / "ray")] and steps[-1] == 20
    for step in steps:
        _assert_same_checkpoint(tmp_path / "ray" / f"step-{step:08d}", tmp_path / "local" / f"step-{step:08d}")
    assert (tmp_path / "ray" / "best_model.safetensors").is_file()


def _assert_same_checkpoint(got_dir, want_dir) -> None:
    got, want = read_index(got_dir), read_index(want_dir)
    fields = lambda index: json.dumps({k: v for k, v in index.items() if k != "files"}, sort_keys=True)  # noqa: E731
    assert fields(got) == fields(want), got_dir
    got_params, want_params = consolidate(got_dir, got), consolidate(want_dir, want)
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        assert (got_params[name] - value).abs().max() <= TOL * value.abs().max(), (got_dir, name)
