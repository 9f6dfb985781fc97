"""A fuzz test of the command line: random commands, flags, meshes, paths and plan edits.

Each drawn command runs in-process (`fivedc.cli.main.main`) in a scratch directory
holding copies of the example models and a saved plan (some drawn edits mutate
it). Whatever is drawn, the command must: exit with a documented code other than
4 (an internal error is a bug the fuzzer found), print no traceback, write nothing
when it fails, and leave no process or worker-pool folder behind. Jobs that do
start ranks go to the session's worker pool, so the test stays fast.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivedc.cli.main import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODELS = ["gpt.5d", "tiny_llama.5d", "moe.5d", "missing.5d", "plan.json", "edited.json", "folder", "folder/x.json"]
SIZES = st.sampled_from(["0", "1", "1", "2", "2", "3", "4", "8", "-1", "1.5", "x"])
VALID_MESHES = ["1x1x1x1x1", "2x1x2x1x1", "1x2x1x1x1", "1x1x1x2x1", "1x1x1x1x2", "dp=2", "tp=2", "1x2x2x1x1"]
MESHES = st.one_of(
    st.sampled_from(VALID_MESHES), st.sampled_from(VALID_MESHES), st.sampled_from(VALID_MESHES),
    st.builds(lambda s: "x".join(s), st.lists(SIZES, min_size=5, max_size=5)),
    st.builds(lambda a, n: f"{a}={n}", st.sampled_from(["dp", "tp", "pp", "cp", "ep", "xp"]), SIZES),
    st.sampled_from(["", "2x2", "dp=2,dp=2", "1x1x1x1x1", "2x1x2x1x1", "1x2x1x1x1"]),
)
NUMBERS = st.sampled_from(["0", "1", "2", "4", "-1", "nan", "inf", "1e-9", "25", "x"])
FLAGS = st.lists(st.one_of(
    st.just(["--sp"]), st.just(["--no-sp"]), st.just(["--no-overlap"]), st.just(["-q"]),
    st.tuples(st.just("--zero"), NUMBERS).map(list),
    st.tuples(st.just("--bucket-mb"), NUMBERS).map(list),
    st.tuples(st.just("--schedule"), st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev",
                                                      "dualpipe", "nosuch"])).map(list),
    st.tuples(st.just("--microbatches"), NUMBERS).map(list),
    st.tuples(st.just("--virtual"), NUMBERS).map(list),
    st.tuples(st.just("--pp-layout"), st.sampled_from(["1,1", "7,7,7", "0,2", "x", "-1,3"])).map(list),
    st.tuples(st.just("--cp-attention"), st.sampled_from(["ring", "allgather", "x"])).map(list),
    st.tuples(st.just("--cp-layout"), st.sampled_from(["balanced", "contiguous", "x"])).map(list),
    st.tuples(st.just("--dtype"), st.sampled_from(["fp64", "fp32", "bf16", "int8"])).map(list),
    st.tuples(st.just("--steps"), NUMBERS).map(list),
    st.tuples(st.just("--tol"), NUMBERS).map(list),
    st.tuples(st.just("-o"), st.sampled_from(["out.json", "gpt.5d", "folder", "nowhere/out.json", "plan.json",
                                              "link.json", "out.png"])).map(list),
), max_size=3)
EDITS = st.sampled_from([None, ("mesh", "sizes", "dp", 3), ("mesh", "sizes", "tp", 2.0), ("version", "1"),
                         ("dtype", "int8"), ("zero", 7), ("collectives", 0, "count", 10**9), ("graph", "dims", 0, 1, -4)])
COMMANDS = st.sampled_from(["compile", "compile", "check", "diff", "show", "verify", "run"])


@pytest.fixture(scope="module")
def scratch():
    folder = Path(tempfile.mkdtemp(prefix="fivedc-fuzz-"))
    for name in ("gpt.5d", "tiny_llama.5d", "moe.5d"):
        shutil.copy(EXAMPLES / name, folder / name)
    (folder / "folder").mkdir()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        assert main(["compile", "gpt.5d", "--mesh", "1x1x2x1x1", "--dtype", "fp32", "-q", "-o", "plan.json"]) == 0
        os.symlink("/etc/hostname", "link.json")
        yield folder
    finally:
        os.chdir(cwd)
        shutil.rmtree(folder, ignore_errors=True)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in folder.rglob("*")}


def _edit(path: Path, edit) -> None:
    data = json.loads((path.parent / "plan.json").read_text())
    if edit is not None:
        *keys, value = edit
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    path.write_text(json.dumps(data))


def _pool_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("fivedc-pool-")}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=COMMANDS, model=st.sampled_from(MODELS), other=st.sampled_from(MODELS), mesh=MESHES,
       flags=FLAGS, edit=EDITS)
def test_the_cli_never_crashes_and_never_writes_on_error(scratch, worker_pool, monkeypatch, capsys,
                                                         command, model, other, mesh, flags, edit) -> None:
    from fivedc.runtime import pool

    monkeypatch.setattr(pool, "run_once", lambda fn, *, world, payload, **_: worker_pool.run(
        fn, world=world, payload=payload))
    _edit(scratch / "edited.json", edit)
    argv = [command]
    if command == "diff":
        argv += [model if model.endswith(".json") else f"{model}@{mesh}", other if other.endswith(".json") else f"{other}@{mesh}"]
    elif command == "show":
        argv += [model, "--schedule", "out.png"]
    else:
        argv += [model]
        if command in ("compile", "verify") or not model.endswith(".json"):
            argv += ["--mesh", mesh]
    argv += [part for flag in flags for part in flag]
    if command in ("verify", "run") and "--steps" not in argv:
        argv += ["--steps", "1"]
    before, pools, children = _snapshot(scratch), _pool_dirs(), set(multiprocessing.active_children())
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code in (0, 1, 2, 3), f"fivedc {' '.join(argv)} exited {code}:\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, f"fivedc {' '.join(argv)}:\n{err}"
    if code != 0:
        assert _snapshot(scratch) == before, f"fivedc {' '.join(argv)} failed but wrote:\n{err}"
    assert _pool_dirs() <= pools
    assert set(multiprocessing.active_children()) <= children | set(worker_pool._procs.values())
    for name in ("out.json", "out.png", "folder/out.json"):
        (scratch / name).unlink(missing_ok=True)
