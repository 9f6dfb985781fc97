"""The worker pool: results by rank, errors naming the failing rank, recovery, and launcher checks.

Job functions live at module level because the pool pickles them by reference.
Failing jobs are followed by a normal one to show the pool recovers; the hung and
dead-worker cases cost a worker restart each, so they run on two ranks only, the
collective-timeout cases on a small pool of their own with a 2 s timeout. The last
tests start a parent process with a pool and kill or interrupt it (Linux: they read
/proc to find the processes left in its session).
"""

from __future__ import annotations

import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import fivedc.runtime.pool as pool_module
from fivedc.errors import FivedcError, MeshError, ShapeError, SourceLoc, VerifyMismatch
from fivedc.ir.mesh import Mesh
from fivedc.runtime.pool import (
    RankError, RankInfo, WorkerError, WorkerPool, check_world, init_from_env, run_once,
)


def identify(info: RankInfo, payload: int) -> tuple[int, int, str, int, float, int]:
    total = torch.tensor([float(info.rank)])
    dist.all_reduce(total)
    return info.rank, info.world, info.device, payload, total.item(), os.getpid()


def fail_on_one(info: RankInfo, blocked: bool) -> int:
    """Rank 1 raises; with `blocked` the others wait in a collective it never joins."""
    if info.rank == 1:
        raise ValueError("rank one is broken")
    if blocked:
        dist.all_reduce(torch.ones(1))
    return info.rank


def hang_or_die(info: RankInfo, how: str) -> int:
    if info.rank == 1 and how == "hang":
        time.sleep(600)
    if info.rank == 1 and how == "die":
        os._exit(3)
    return info.rank


def compute_then_sum(info: RankInfo, seconds: float) -> float:
    """Every rank computes (sleeps) `seconds`, longer than the pool's timeout, then they meet."""
    time.sleep(seconds)
    total = torch.tensor([float(info.rank)])
    dist.all_reduce(total)
    return total.item()


def raise_user_error(info: RankInfo, kind: str) -> int:
    if info.rank == 1:
        if kind == "shape":
            loc = SourceLoc("model.5d", 3, 7, "  x = linear(h, w)")
            raise ShapeError("hidden 30 is not divisible by tp = 4", loc=loc, hint="make hidden a multiple of 4")
        raise VerifyMismatch("loss differs by 0.5", hint="look at the gradients")
    return info.rank


def report_steps(info: RankInfo, steps: int) -> int:
    for step in range(steps):
        dist.barrier()  # every rank reports; only rank 0's lines reach the parent
        info.report(f"step {step} on rank {info.rank}")
    return info.rank


def check_ok(pool: WorkerPool, world: int) -> None:
    expected = [(r, world, "cpu", 7, float(sum(range(world)))) for r in range(world)]
    assert [got[:5] for got in pool.run(identify, world=world, payload=7)] == expected


def test_results_by_rank_for_each_world(worker_pool: WorkerPool) -> None:
    for world in (2, 4, 8, 2):
        check_ok(worker_pool, world)


@pytest.mark.parametrize("blocked", [False, True], ids=["alone", "others-blocked"])
def test_error_names_rank_and_pool_recovers(worker_pool: WorkerPool, blocked: bool) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        worker_pool.run(fail_on_one, world=4, payload=blocked)
    assert time.monotonic() - started < 30
    assert caught.value.rank == 1
    assert "rank 1 of 4 failed in fail_on_one" in str(caught.value)
    assert "ValueError: rank one is broken" in str(caught.value)
    assert isinstance(caught.value, FivedcError)
    assert caught.value.exit_code == 3 and not isinstance(caught.value, RankError)
    check_ok(worker_pool, 4)


@pytest.mark.parametrize("kind", ["shape", "mismatch"])
def test_user_error_in_a_rank_keeps_its_message_and_exit_code(worker_pool: WorkerPool, kind: str) -> None:
    with pytest.raises(RankError) as caught:
        worker_pool.run(raise_user_error, world=2, payload=kind)
    error = caught.value
    assert error.rank == 1 and "Traceback" not in error.render()
    if kind == "shape":
        assert error.exit_code == 2
        assert error.message == "hidden 30 is not divisible by tp = 4 (on rank 1 of 2 in raise_user_error)"
        assert error.render().splitlines() == [
            "model.5d:3:7: error: hidden 30 is not divisible by tp = 4 (on rank 1 of 2 in raise_user_error)",
            "      x = linear(h, w)",
            "          ^",
            "hint: make hidden a multiple of 4",
        ]
    else:
        assert error.exit_code == 1 and error.loc is None
        assert error.render().startswith("error: loss differs by 0.5 (on rank 1 of 2")
        assert error.hint == "look at the gradients"
    check_ok(worker_pool, 2)


def test_dead_worker_is_replaced(worker_pool: WorkerPool) -> None:
    with pytest.raises(WorkerError) as caught:
        worker_pool.run(hang_or_die, world=2, payload="die")
    assert caught.value.rank == 1 and caught.value.exit_code == 3
    assert "died (exit code 3)" in str(caught.value)
    check_ok(worker_pool, 2)


@pytest.fixture(scope="module")
def small_pool() -> Iterator[WorkerPool]:
    """Two workers whose ranks wait at most 2 s in a collective."""
    with WorkerPool(2, timeout_s=2.0) as pool:
        yield pool


def test_rank_that_never_arrives_is_named(small_pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 returns and waits in the closing barrier; rank 1 sleeps outside any collective."""
    monkeypatch.setattr(pool_module, "_ERROR_GRACE_S", 1.0)
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        small_pool.run(hang_or_die, world=2, payload="hang")
    assert 2.0 <= time.monotonic() - started < 20
    error = caught.value
    assert error.rank == 1 and error.exit_code == 3
    assert error.message == ("rank(s) 1 of 2 did not arrive at a collective in hang_or_die: "
                             "rank(s) 0 waited 2 s for them and timed out")
    assert "--timeout SECONDS (now 2)" in error.hint
    check_ok(small_pool, 2)


def test_long_computation_is_not_a_timeout(small_pool: WorkerPool) -> None:
    """The ranks compute 3 s, past the 2 s timeout, but arrive together: no error. A
    Ctrl-C sent to the workers meanwhile does nothing (the parent is the one to act)."""
    workers = [pid for *_, pid in small_pool.run(identify, world=2, payload=0)]
    interrupt = threading.Timer(1.0, lambda: [os.kill(pid, signal.SIGINT) for pid in workers])
    interrupt.start()
    started = time.monotonic()
    assert small_pool.run(compute_then_sum, world=2, payload=3.0) == [1.0, 1.0]
    assert time.monotonic() - started >= 3.0
    interrupt.join()


def test_ctrl_c_as_a_worker_starts_is_ignored(small_pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new worker gets SIGINT right after it is spawned, while Python starts."""
    spawn_quietly = pool_module.sigint_blocked

    @contextmanager
    def spawn_then_interrupt() -> Iterator[None]:
        with spawn_quietly():
            yield
        for proc in small_pool._procs.values():
            os.kill(proc.pid, signal.SIGINT)

    monkeypatch.setattr(pool_module, "sigint_blocked", spawn_then_interrupt)
    small_pool.close()  # the next job starts new workers
    check_ok(small_pool, 2)


def test_progress_reaches_the_parent_from_rank_zero(worker_pool: WorkerPool) -> None:
    lines: list[str] = []
    assert worker_pool.run(report_steps, world=4, payload=3, on_progress=lines.append) == [0, 1, 2, 3]
    assert lines == ["step 0 on rank 0", "step 1 on rank 0", "step 2 on rank 0"]
    RankInfo(0, 1, "cpu").report("outside a pool: nothing happens")


def test_unpicklable_job_and_oversized_world(worker_pool: WorkerPool) -> None:
    with pytest.raises(WorkerError, match="module-level"):
        worker_pool.run(lambda info, payload: None, world=2, payload=None)
    with pytest.raises(MeshError, match="does not fit"):
        worker_pool.run(identify, world=9, payload=None)


def test_run_once() -> None:
    lines: list[str] = []
    assert run_once(report_steps, world=1, payload=2, timeout_s=30, on_progress=lines.append) == [0]
    assert lines == ["step 0 on rank 0", "step 1 on rank 0"]
    with pytest.raises(FivedcError, match="--timeout SECONDS with SECONDS > 0"):
        WorkerPool(1, timeout_s=0)


def test_check_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_world(4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world(4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(MeshError) as caught:
        check_world(4, mesh=Mesh.parse("2x1x2x1x1"))
    assert caught.value.message == "the mesh 2x1x2x1x1 needs 4 processes but the launcher started 8"
    assert "--nproc-per-node=4" in caught.value.hint


def test_init_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(MeshError, match="RANK is not set"):
        init_from_env()
    with socket.socket() as probe:  # a free port for the env:// rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    try:
        assert init_from_env() == RankInfo(0, 1, "cpu")
        assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- a parent process killed or interrupted ------------------------------------------
PARENT = textwrap.dedent('''
    import os, sys, threading, time
    from fivedc.runtime.pool import WorkerPool

    def nap(info, seconds):
        time.sleep(seconds)
        return os.getpid()

    def main():
        with WorkerPool(2) as pool:
            print("starting", flush=True)
            print(*pool.run(nap, world=2, payload=0.0), flush=True)
            pool.run(nap, world=2, payload=600.0)

    if __name__ == "__main__":
        try:
            if sys.argv[1:] == ["thread"]:  # workers spawned from a thread: no PR_SET_PDEATHSIG
                thread = threading.Thread(target=main)
                thread.start()
                thread.join()
            else:
                main()
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
''')
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def start_parent(tmp_path, *args: str) -> subprocess.Popen:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def read_line(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    """The parent's next line, read from its pipe directly: a buffered reader could take two
    lines at once and leave `select` waiting for one already read."""
    fd, buffered = proc.stdout.fileno(), getattr(proc, "unread", b"")
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buffered:
        left = deadline - time.monotonic()
        chunk = os.read(fd, 4096) if left > 0 and select.select([fd], [], [], left)[0] else b""
        if not chunk:
            proc.kill()
            pytest.fail(f"the parent printed nothing; stderr:\n{proc.communicate()[1]}")
        buffered += chunk
    line, _, proc.unread = buffered.partition(b"\n")
    return line.decode().strip()


def session(sid: int) -> list[int]:
    """The processes of session `sid` that still run (exited, unreaped ones do not)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, _ppid, _pgrp, owner = stat.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if state != "Z" and int(owner) == sid:
            found.append(int(entry))
    return found


def gone_within(sid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def pool_folders(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"fivedc-pool-{pid}-*"))


@linux_only
def test_workers_and_folder_go_with_a_killed_parent(tmp_path) -> None:
    """kill: the workers die by PR_SET_PDEATHSIG and the next pool removes the folder;
    term: the parent's handler stops them and removes it; kill-thread: the workers'
    watching thread sees the parent gone, removes the folder and exits. The three
    parents run at once (each its own session), so their workers start together."""
    hows = ("kill", "term", "kill-thread")
    procs = {}
    for how in hows:
        (tmp_path / how).mkdir()
        procs[how] = start_parent(tmp_path / how, *(["thread"] if how == "kill-thread" else []))
    for how, proc in procs.items():
        assert read_line(proc) == "starting", how
        workers = [int(pid) for pid in read_line(proc).split()]
        assert len(workers) == 2 and set(workers) <= set(session(proc.pid)), how
        assert len(pool_folders(proc.pid)) == 1, how
    for how, proc in procs.items():
        sig = signal.SIGTERM if how == "term" else signal.SIGKILL
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == -sig, how
    for how, proc in procs.items():
        assert gone_within(proc.pid, 10) == [], how  # the workers and multiprocessing's resource tracker
    for how in ("term", "kill-thread"):  # removed by the parent's handler, or the workers' thread
        assert pool_folders(procs[how].pid) == [], how
    WorkerPool(1).close()  # sweeps the folder SIGKILL left (its owner is gone)
    assert pool_folders(procs["kill"].pid) == []


def test_a_folder_half_removed_by_another_sweep_is_removed_once_old() -> None:
    """Two pools starting at once may sweep one dead owner's folder together and leave it
    without its owner file; such a folder goes once older than a new one can be."""
    from fivedc.runtime import pool_cleanup

    dead = subprocess.Popen(["true"])
    dead.wait()
    old = tempfile.mkdtemp(prefix=f"{pool_cleanup.PREFIX}{dead.pid}-")
    new = tempfile.mkdtemp(prefix=f"{pool_cleanup.PREFIX}{dead.pid}-")
    stale = time.time() - 2 * pool_cleanup.ORPHAN_AFTER_S
    os.utime(old, (stale, stale))
    try:
        shutil.rmtree(pool_cleanup.new_folder())
        assert not os.path.exists(old)
        assert os.path.exists(new)  # its owner file may be on its way
    finally:
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(new, ignore_errors=True)


@linux_only
def test_ctrl_c_stops_everything_with_one_line(tmp_path) -> None:
    """SIGINT to the whole process group, as a terminal sends it, most likely while the
    workers import torch (else during the job): only the parent reacts."""
    proc = start_parent(tmp_path)
    assert read_line(proc) == "starting"
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    started = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - started < 15
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert stderr.strip().splitlines()[-1] == "interrupted" and stderr.count("interrupted") == 1
    assert gone_within(proc.pid, 10) == []
    assert pool_folders(proc.pid) == []


LOCKING_PARENT = textwrap.dedent('''
    import multiprocessing
    from fivedc.runtime.pool import run_once

    def lock(info, payload):  # a library that makes a multiprocessing lock at import (tqdm, via transformers)
        global held
        held = multiprocessing.get_context("spawn").Lock()
        return info.rank

    if __name__ == "__main__":
        print(run_once(lock, world=1, payload=None, timeout_s=60))
''')


def test_workers_leave_no_semaphore_for_the_parent_to_warn_of(tmp_path) -> None:
    """A worker exits with os._exit (no slow interpreter shutdown) after multiprocessing's own
    clean-up: the parent's resource tracker prints no "leaked semaphore objects" warning."""
    script = tmp_path / "locking.py"
    script.write_text(LOCKING_PARENT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[0]", run.stderr
    assert "leaked" not in run.stderr, run.stderr


def _threads(info, payload) -> int:
    """The threads of this worker, native ones included (gloo's pt_gloo_runloop, gloo_tcp_loop)."""
    return len(os.listdir("/proc/self/task"))


@linux_only
@pytest.mark.parametrize("model, mesh", [
    # the gradient sync overlapped with backward (over dp here, over ep and dp there, with ep's own
    # all-to-all groups): each left one gloo group's threads per run (3 more each run, on every rank
    # that synced) while a parameter's hook held the sync object (runtime/buckets.call_weakly)
    ("gpt", "2x1x1x1x1"), ("moe", "1x1x1x1x2"),
])
def test_a_pool_run_leaves_no_threads_behind(worker_pool, model: str, mesh: str) -> None:
    """Workers live as long as the test session: a job's process groups (and their gloo threads)
    must go with the job, or a long run grows hundreds of threads per worker."""
    from fivedc.frontends.dsl_file import load_model
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph
    from fivedc.runtime.train import TrainSettings
    from fivedc.runtime.verify import single_device_mesh, verify_plan

    graph = load_model(f"examples/{model}.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64"))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    counts = []
    for _ in range(2):  # the first run may start what stays (a library's threads): compare the next
        verify_plan(plan, reference, settings=TrainSettings(steps=1), pool=worker_pool)
        counts.append(worker_pool.run(_threads, world=4, payload=None))
    # a leak grows; threads an earlier test started on a worker may still be going away
    assert all(later <= first for first, later in zip(counts[0], counts[1])), counts


def where(info: RankInfo, payload: None) -> str:
    return os.getcwd()


def test_a_job_is_unpickled_where_its_caller_is_though_the_last_jobs_folder_is_gone(tmp_path, monkeypatch) -> None:
    """A job runs in its caller's current folder; the next one is unpickled there too, not in
    the folder the last job left the worker in, which its caller may have deleted since
    (unpickling imports the job's module, and a module may ask for the cwd as it loads)."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "asks_the_cwd.py").write_text(textwrap.dedent("""
        import os
        LOADED_IN = os.getcwd()  # what hypothesis does on import: fails in a deleted folder

        def job(info, payload):
            return LOADED_IN
    """))
    monkeypatch.syspath_prepend(str(modules))  # the workers start with this path
    gone, here = tmp_path / "gone", tmp_path / "here"
    gone.mkdir()
    here.mkdir()
    with WorkerPool(1) as pool:
        monkeypatch.chdir(gone)
        assert pool.run(where, world=1, payload=None) == [str(gone)]
        monkeypatch.chdir(here)
        shutil.rmtree(gone)
        import asks_the_cwd

        assert pool.run(asks_the_cwd.job, world=1, payload=None) == [str(here)]
