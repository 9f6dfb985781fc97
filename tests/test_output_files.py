"""Output files (`fivedc.files`): what a write refuses, what it keeps, what it leaves behind.

Each refusal (a directory, a symlink out of the working tree, a FIFO standing in for
a device, the command's own input, a missing or read-only directory) is an
`OutputError` with exit code 2 that leaves the directory exactly as it was; a write
that succeeds gets the mode a plain open() would give, keeps an existing file's
mode and writes through a symlink inside the tree. The CLI checks are run through
`fivedc.cli.main.main` (and once through `python -m fivedc.cli.main`) with no traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import fivedc.cli.main
from fivedc.cli.main import main
from fivedc.files import OutputError, check_output, write_output
from fivedc.plan.execution_plan import ExecutionPlan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working tree (the cwd): `tmp_path/tree`, with `tmp_path` itself outside it."""
    root = tmp_path / "tree"
    root.mkdir()
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def umask():
    """Set the umask for one test and restore it after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def refused(path: Path | str, match: str, *, directory: Path, **kwargs) -> OutputError:
    """`write_output(path)` raises an exit-2 `OutputError` with a hint and writes nothing."""
    before = listing(directory)
    with pytest.raises(OutputError, match=match) as info:
        write_output(path, "new\n", **kwargs)
    assert info.value.exit_code == 2 and info.value.hint
    assert listing(directory) == before
    return info.value


# ---- refusals ----------------------------------------------------------------------------------
def test_a_directory_is_refused(tree: Path) -> None:
    (tree / "plans").mkdir()
    error = refused(tree / "plans", "is a directory", directory=tree)
    assert "plans" in error.message and "name a file inside it" in error.hint
    refused("plans/", "names a directory", directory=tree)
    refused("missing/", "names a directory", directory=tree)  # not created as a file named `missing`
    assert (tree / "plans").is_dir() and not (tree / "missing").exists()


def test_a_symlink_out_of_the_working_tree_is_refused(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("keep\n")
    link = tree / "plan.json"
    link.symlink_to(outside)
    refused(link, "outside the working tree", directory=tree)
    refused("plan.json", "outside the working tree", directory=tree)
    assert outside.read_text() == "keep\n" and link.is_symlink() and os.readlink(link) == str(outside)


def test_a_fifo_is_refused_like_a_device(tree: Path) -> None:
    fifo = tree / "pipe.json"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file", directory=tree)
    (tree / "to_pipe.json").symlink_to("pipe.json")  # inside the tree, but still not a regular file
    refused(tree / "to_pipe.json", "not a regular file", directory=tree)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_the_commands_own_input_is_refused_however_it_is_spelled(tree: Path) -> None:
    model = tree / "model.5d"
    model.write_text("model m {}\n")
    refused(model, "is the input file", directory=tree, inputs=(model,))
    refused("./model.5d", "is the input file", directory=tree, inputs=("model.5d",))
    os.link(model, tree / "hardlink.5d")
    refused(tree / "hardlink.5d", "is the input file", directory=tree, inputs=(model,))
    assert model.read_text() == "model m {}\n"
    write_output(tree / "other.json", "ok\n", inputs=(model, tree / "gone.5d"))  # other files are fine


def test_a_missing_directory_is_refused(tree: Path) -> None:
    error = refused(tree / "no" / "such" / "plan.json", "does not exist", directory=tree)
    assert "mkdir -p" in error.hint and str(tree / "no" / "such") in error.message
    (tree / "file").write_text("")
    refused(tree / "file" / "plan.json", "is not a directory", directory=tree)


def as_a_user_sees_it(monkeypatch, locked: Path) -> None:
    """Root writes into a read-only file or directory anyway (`os.access` says yes): run as root,
    `os.access` is made to answer for `locked` what it answers a user who is not root."""
    if ROOT:
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))


def test_a_read_only_directory_is_refused(tree: Path, monkeypatch) -> None:
    locked = tree / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    as_a_user_sees_it(monkeypatch, locked)
    try:
        refused(locked / "plan.json", "is not writable", directory=locked)
    finally:
        locked.chmod(0o755)


def test_an_unwritable_directory_is_refused_even_when_checked_as_root(tree: Path, monkeypatch) -> None:
    """What a user who is not root sees: `os.access` says no, as it does for them."""
    locked = tree / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))
    refused(locked / "plan.json", "is not writable", directory=locked)


def test_a_read_only_file_is_refused(tree: Path, monkeypatch) -> None:
    target = tree / "plan.json"
    target.write_text("keep\n")
    target.chmod(0o444)
    as_a_user_sees_it(monkeypatch, target)
    refused(target, "is read-only", directory=tree)
    assert target.read_text() == "keep\n"


# ---- failures leave nothing behind ---------------------------------------------------------------
def _fail(error: BaseException):
    def writer(tmp: Path) -> None:
        tmp.write_bytes(b"half a pic")
        raise error
    return writer


def test_a_failed_write_is_an_error_and_leaves_the_target_and_no_temp_file(tree: Path) -> None:
    target = tree / "plan.json"
    target.write_text("old\n")
    with pytest.raises(OutputError, match="No space left on device") as info:
        write_output(target, _fail(OSError(errno.ENOSPC, "No space left on device")))
    assert info.value.exit_code == 2 and str(target) in info.value.message
    assert listing(tree) == ["plan.json"] and target.read_text() == "old\n"


def test_an_interrupt_leaves_no_temp_file(tree: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        write_output(tree / "pic.png", _fail(KeyboardInterrupt()))
    assert listing(tree) == []


# ---- what a write keeps ------------------------------------------------------------------------------
@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_honours_the_umask(tree: Path, umask, mask: int, mode: int) -> None:
    umask(mask)
    write_output(tree / "plan.json", "new\n")
    assert stat.S_IMODE(os.stat(tree / "plan.json").st_mode) == mode
    assert (tree / "plan.json").read_text() == "new\n" and listing(tree) == ["plan.json"]


def test_an_existing_file_keeps_its_mode(tree: Path, umask) -> None:
    umask(0o077)
    target = tree / "plan.json"
    target.write_text("old\n")
    target.chmod(0o654)
    write_output(target, b"new\n")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o654 and target.read_text() == "new\n"


def test_a_symlink_inside_the_tree_is_written_through(tree: Path) -> None:
    (tree / "real").mkdir()
    real = tree / "real" / "plan.json"
    real.write_text("old\n")
    real.chmod(0o640)
    link = tree / "plan.json"
    link.symlink_to("real/plan.json")
    assert check_output(link) == real.resolve()
    write_output(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == "real/plan.json"
    assert real.read_text() == "new\n" and stat.S_IMODE(os.stat(real).st_mode) == 0o640
    assert listing(tree / "real") == ["plan.json"] and listing(tree) == ["plan.json", "real"]
    dangling = tree / "later.json"
    dangling.symlink_to("real/later.json")
    write_output(dangling, "made\n")
    assert dangling.is_symlink() and (tree / "real" / "later.json").read_text() == "made\n"


def test_dev_null_discards_the_output_and_is_left_as_it_is(tree: Path) -> None:
    before = os.stat(os.devnull)
    assert write_output(os.devnull, "plan\n") is None
    seen = []
    assert write_output(os.devnull, lambda tmp: seen.append(tmp.suffix) or 7) == 7
    after = os.stat(os.devnull)
    assert seen == [""] and (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)


# ---- the commands ------------------------------------------------------------------------------------
def _copy(name: str, tree: Path) -> Path:
    return Path(shutil.copy(EXAMPLES / name, tree / name))


def test_compile_refuses_to_overwrite_the_model(tree: Path, capsys) -> None:
    model = _copy("gpt.5d", tree)
    before = model.read_bytes()
    assert main(["compile", "gpt.5d", "--mesh", "2x1x2x1x1", "-o", "./gpt.5d"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # wrapped to 100 columns
    assert "is the input file" in err and "Traceback" not in err
    assert model.read_bytes() == before and listing(tree) == ["gpt.5d"]
    factory = tree / "net.py"
    factory.write_text("raise SystemExit('the factory file was imported')\n")
    assert main(["compile", "net.py:factory", "--mesh", "1x1x1x1x1", "-o", "net.py"]) == 2
    assert "is the input file" in " ".join(capsys.readouterr().err.split()) and "SystemExit" in factory.read_text()


def test_compile_checks_the_output_before_compiling(tree: Path, capsys, monkeypatch) -> None:
    (tree / "somedir").mkdir()
    _copy("gpt.5d", tree)
    monkeypatch.setattr(fivedc.cli.main, "compile_model", lambda *a, **k: pytest.fail("compiled before checking -o"))
    for output, message in (("missing/x.json", "does not exist"), ("somedir/", "names a directory"),
                            ("somedir", "is a directory")):
        assert main(["compile", "gpt.5d", "--mesh", "2x1x2x1x1", "-o", output]) == 2
        err = " ".join(capsys.readouterr().err.split())  # wrapped to 100 columns
        assert message in err and "hint:" in err and "Traceback" not in err
    assert listing(tree) == ["gpt.5d", "somedir"] and listing(tree / "somedir") == []


def test_the_command_line_entry_point_refuses_without_a_traceback(tree: Path) -> None:
    model = _copy("gpt.5d", tree)
    before = model.read_bytes()
    result = subprocess.run([sys.executable, "-m", "fivedc.cli.main", "compile", "gpt.5d", "--mesh", "2x1x2x1x1",
                             "-o", "gpt.5d"], capture_output=True, text=True, cwd=tree)
    assert result.returncode == 2 and "is the input file" in result.stderr and "Traceback" not in result.stderr
    assert model.read_bytes() == before


def test_show_writes_the_picture_by_the_same_rules(tree: Path, tmp_path: Path, capsys, umask) -> None:
    assert main(["compile", str(EXAMPLES / "tiny_llama.5d"), "--mesh", "1x2x1x1x1", "-q", "-o", "p.json"]) == 0
    plan = ExecutionPlan.load("p.json")
    with pytest.raises(OutputError, match="is a directory"):
        plan.save(tree)
    with pytest.raises(OutputError, match="is the input file"):
        plan.save("p.json", inputs=(tree / "p.json",))
    (tree / "dir.png").mkdir()
    (tree / "away.png").symlink_to(tmp_path / "away.png")
    os.mkfifo(tree / "fifo.png")
    capsys.readouterr()
    for out, message in (("dir.png", "is a directory"), ("away.png", "outside the working tree"),
                         ("fifo.png", "not a regular file"), ("no/s.png", "does not exist")):
        assert main(["show", "p.json", "--schedule", out]) == 2
        err = " ".join(capsys.readouterr().err.split())  # wrapped to 100 columns
        assert message in err and "Traceback" not in err
    umask(0o022)
    before = set(listing(tree))
    assert main(["show", "p.json", "--schedule", "s.png"]) == 0
    assert set(listing(tree)) == before | {"s.png"} and not (tmp_path / "away.png").exists()
    assert (tree / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(os.stat(tree / "s.png").st_mode) == 0o644
