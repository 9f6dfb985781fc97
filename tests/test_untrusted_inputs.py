"""Issue 40: nothing a command writes destroys data, and a checkpoint from someone else is safe to open.

- One output rule for every file a command writes (`fivedc/outputs.py`): `--log` never
  appends to the token file, the model's source, a symlink out of the tree, a FIFO or
  any file that is not a fivedc log; `export -o` never writes into the checkpoint it
  reads; two outputs of one command never name one file; a refusal is exit 2 that
  writes nothing, an empty log included.
- A save directory belongs to one run (an fcntl lock; a dead holder's is taken over).
- Non-finite state is never committed: a NaN loss or gradient norm stops with exit 1
  naming the step; a NaN validation loss writes no best model.
- A checkpoint is untrusted: every index field type-checked, piece files inside the
  folder, shard bytes checked against the digests saved, a damaged one is exit 2 naming
  the file and the field, never a worker traceback; a hypothesis test mutates fields,
  bytes and piece paths of one saved checkpoint (copied per example) and exports it
  in-process.
- Leftovers: a SIGTERM'd run removes its temp folder, a kill -9'd one's is swept at
  the next start; --seed and --timeout outside their ranges are refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fivedc.cli.main import main
from fivedc.errors import NonFiniteError
from fivedc.log_file import FORMAT, rows_of
from fivedc.runtime import train_loop
from fivedc.runtime.checkpoint import committed
from fivedc.runtime.train_config import SEED_MAX
from train_helpers import ROOT, job_for, make_tokens, one_device, plan_of

MODEL = str(ROOT / "examples" / "tiny_llama.5d")
STEP2, STEP4 = "step-00000002", "step-00000004"
SHARD = "rank-00000.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Tokens and a save directory of tiny_llama on one device, steps 2 and 4 saved (in-process)."""
    root = tmp_path_factory.mktemp("saved")
    data = make_tokens(root)
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1", dtype="fp32"), data, steps=4, save_every=2),
                              save_dir=str(root / "ck"))
    one_device(job)
    return root


@pytest.fixture
def tree(tmp_path: Path, saved: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working tree (the cwd) with train.bin, val.bin and a copy of the checkpoints in ck/."""
    root = tmp_path / "tree"
    root.mkdir()
    for name in ("train.bin", "val.bin"):
        shutil.copy(saved / name, root / name)
    shutil.copytree(saved / "ck", root / "ck")
    monkeypatch.chdir(root)
    return root


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory or a FIFO, a link's target for a link)."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = os.readlink(path).encode()
        else:
            out[key] = path.read_bytes() if path.is_file() else None
    return out


def refused(argv: list[str], capsys, root: Path, *, code: int = 2) -> str:
    """The command exits `code` with a message and no traceback, and changes nothing under
    root; the message with its lines joined (a checkpoint's is wrapped at 100 columns)."""
    before = snapshot(root)
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err and err.startswith("error: ")
    assert snapshot(root) == before
    return " ".join(err.split())


TRAIN = ["train", MODEL, "--mesh", "1x1x1x1x1", "--data", "train.bin", "--steps", "2"]


# ---- one output rule -------------------------------------------------------------------
@pytest.mark.parametrize("case,flags,message", [
    ("data", ["--log", "train.bin"], "is the input file train.bin"),
    ("model", ["--log", "model.5d"], "is the input file"),
    ("val", ["--val", "val.bin", "--log", "val.bin"], "is the input file val.bin"),
    ("other data", ["--log", "val.bin"], "val.bin exists and is not a fivedc training log"),
    ("notes", ["--log", "notes.txt"], "notes.txt exists and is not a fivedc training log"),
    ("link out", ["--log", "link.jsonl"], "is a symlink to"),
    ("fifo", ["--log", "fifo.jsonl"], "is not a regular file"),
    ("two outputs", ["--log", "x.png", "--plot", "x.png"], "name the same file"),
    ("reserved", ["--resume", "ck", "--steps", "6", "--log", "ck/step-00000009"], "which the run writes itself"),
    ("best model", ["--resume", "ck", "--steps", "6", "--plot", "ck/best_model.safetensors.png", "--log",
                    "ck/best_model.safetensors"], "is not a fivedc training log"),
    ("in checkpoint", ["--resume", "ck", "--steps", "6", "--log", f"ck/{STEP4}/run.jsonl"], "a checkpoint this"),
    ("pruned", ["--resume", "ck", "--steps", "6", "--log", f"ck/{STEP2}/run.jsonl"], "a checkpoint this"),
    ("save dir link", ["--save-dir", "linkdir"], "is a symlink to"),
    ("save dir file", ["--save-dir", "train.bin"], "is not a directory"),
    ("best model fifo", ["--resume", "ck", "--steps", "6"],
     "--save-dir ck: ck/best_model.safetensors is not a regular"),
])
def test_train_outputs_follow_the_one_rule(tree: Path, tmp_path: Path, capsys, case, flags, message) -> None:
    shutil.copy(MODEL, tree / "model.5d")
    (tree / "notes.txt").write_text("my notes\n")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("outside\n")
    (tree / "link.jsonl").symlink_to(outside)
    (tree / "linkdir").symlink_to(tmp_path)
    os.mkfifo(tree / "fifo.jsonl")
    if case == "best model fifo":
        (tree / "ck" / "best_model.safetensors").unlink()
        os.mkfifo(tree / "ck" / "best_model.safetensors")
    argv = [*TRAIN, *flags]
    if case == "model":
        argv[1] = "model.5d"
    err = refused(argv, capsys, tree)
    assert message in err and "hint: " in err
    assert outside.read_text() == "outside\n"


def test_a_log_is_created_with_its_record_and_appended_to(tree: Path, capsys) -> None:
    assert main([*TRAIN, "--log", "run.jsonl", "--save-dir", "a"]) == 0
    lines = (tree / "run.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"format": FORMAT, "version": 1}
    assert [r["step"] for r in rows_of(tree / "run.jsonl")] == [1, 2]
    # a second run on a save directory in use is refused; once its holder is gone, the lock is taken over
    holder = _hold_lock(tree / "a2")
    try:
        err = refused([*TRAIN, "--log", "run.jsonl", "--save-dir", "a2"], capsys, tree)
        assert "--save-dir a2 is in use by another fivedc train" in err and f"pid {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()
    stale = _dead_scratch_folder()
    assert main([*TRAIN, "--log", "run.jsonl", "--save-dir", "a2", "--seed", "1"]) == 0
    assert [r["step"] for r in rows_of(tree / "run.jsonl")] == [1, 2, 1, 2]
    assert [step for step, _ in committed(tree / "a2")] == [2]
    assert not stale.exists()  # a kill -9'd run's temp folder, swept at this start


def _hold_lock(save_dir: Path) -> subprocess.Popen:
    """Another process holding the save directory's lock until killed."""
    code = ("import sys, time; from fivedc.runtime.save_lock import hold_save_dir\n"
            "with hold_save_dir(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(save_dir)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    return proc


def _dead_scratch_folder() -> Path:
    """A `fivedc-train-PID-*` folder whose process is gone, as kill -9 leaves one."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = Path(tempfile.mkdtemp(prefix=f"fivedc-train-{dead.pid}-"))
    (folder / "owner").write_text(f"{socket.gethostname()} {dead.pid}\n")
    (folder / "init.safetensors").write_bytes(b"left behind")
    return folder


def test_export_never_writes_into_the_checkpoint_it_reads(tree: Path, capsys) -> None:
    for out in (f"ck/{STEP4}/{SHARD}", "ck/best_model.safetensors", f"ck/{STEP4}/model.safetensors"):
        err = refused(["export", "ck", "-o", out], capsys, tree)
        assert out in err
    assert main(["export", "ck", "-o", "model.safetensors"]) == 0


def test_two_outputs_of_one_command_differ_and_show_checks_first(tree: Path, capsys) -> None:
    err = refused(["search", MODEL, "--gpus", "2", "--gpu", "h100", "-o", "x.json", "--json", "./x.json"], capsys,
                  tree)
    assert "--json ./x.json and -o name the same file" in err
    (tree / "pic.png").mkdir()
    err = refused(["show", "missing.plan.json", "--schedule", "pic.png"], capsys, tree)
    assert "pic.png is a directory" in err  # the output is checked before the plan is read


@pytest.mark.parametrize("flags,message", [
    (["--seed", str(SEED_MAX + 1)], f"give --seed between 0 and {SEED_MAX}"),
    (["--seed", "-1"], "--seed -1 must be a whole number >= 0"),
    (["--timeout", "1e-9"], "must be between 1 and 604800 seconds"),
])
def test_numbers_out_of_range_are_refused(tree: Path, capsys, flags, message) -> None:
    assert message in refused([*TRAIN, "--save-dir", "new", *flags], capsys, tree)


def test_the_largest_seed_seeds_every_generator() -> None:
    """SEED_MAX * 1_000_003 plus a 32-bit offset still fits torch's seed range."""
    torch.Generator().manual_seed(SEED_MAX * 1_000_003 + 2**32 - 1)
    with pytest.raises((RuntimeError, ValueError)):  # torch refuses the next one
        torch.Generator().manual_seed((SEED_MAX + 1) * 1_000_003 + 2**32 - 1)


# ---- non-finite state --------------------------------------------------------------------
def test_a_nan_stops_training_and_nothing_of_it_is_saved(tree: Path, capsys) -> None:
    code = main([*TRAIN, "--steps", "4", "--lr", "1e30", "--clip", "0", "--save-dir", "nan", "--save-every", "1",
                 "--val", "val.bin", "--log", "nan.jsonl"])
    err = " ".join(capsys.readouterr().err.split())  # wrapped to 100 columns
    assert code == 1 and "Traceback" not in err
    stopped = [r["step"] for r in rows_of(tree / "nan.jsonl")][-1] + 1
    assert f"step {stopped} reached a " in err and "nan" in err
    assert [step for step, _ in committed(tree / "nan")] == list(range(1, stopped))
    for _, folder in committed(tree / "nan"):
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(folder / SHARD).values() if t.is_floating_point())


def test_a_nan_validation_loss_writes_no_best_model(saved: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(train_loop, "validate", lambda run, batches: math.nan)
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1", dtype="fp32"),
                                      (str(saved / "train.bin"), str(saved / "val.bin")), steps=2, save_every=1),
                              save_dir=str(tmp_path / "ck"))
    with pytest.raises(NonFiniteError, match="step 1 reached a val loss nan") as info:
        one_device(job)
    assert info.value.exit_code == 1
    assert not (tmp_path / "ck" / "best_model.safetensors").exists() and committed(tmp_path / "ck") == []


# ---- checkpoints are untrusted -------------------------------------------------------------
def edit_index(folder: Path, change) -> None:
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def _first_piece(index: dict) -> dict:
    return index["tensors"]["param/tok_emb"]["pieces"][0] if "param/tok_emb" in index["tensors"] else \
        next(iter(index["tensors"].values()))["pieces"][0]


def _set(path: str, value):
    def change(index: dict) -> None:
        *parents, last = path.split(".")
        node = index
        for name in parents:
            node = node[name]
        node[last] = value
    return change


def _truncate(folder: Path) -> None:
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(data[: len(data) // 2])


def _header(folder: Path, header: bytes) -> None:
    """A shard's header length replaced, in a checkpoint without digests (so that the
    safetensors parser, not the digest, meets it)."""
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(header + data[8:])
    edit_index(folder, lambda i: i.pop("files"))


def _truncate_unchecked(folder: Path) -> None:
    _truncate(folder)
    edit_index(folder, lambda i: i.pop("files"))


def _flip(folder: Path) -> None:
    data = bytearray((folder / SHARD).read_bytes())
    data[-100] ^= 0xFF  # a tensor's byte; the header intact
    (folder / SHARD).write_bytes(bytes(data))


def _outside_link(folder: Path) -> None:
    moved = folder.parent.parent / "elsewhere.safetensors"
    shutil.move(folder / SHARD, moved)
    (folder / SHARD).symlink_to(moved)


def _names(**change) -> dict:
    """A traced model's parameter map for layers.0.attn_norm (shape [32]), with `change`."""
    mapping = {"ir_name": "layers.0.attn_norm", "param": "attn_norm", "repeat": "layers", "key": "norm.weight",
               "module_path": "norm", "pattern": "norm", "ir_shape": [32], "key_shape": [32], **change}
    return {"params": [mapping], "aliases": {}}


DAMAGE = {
    "names of a wrong type": (lambda f: edit_index(f, _set("names", _names(ir_shape="32"))),
                              "names.params[0].ir_shape is '32'"),
    "names that do not fit": (lambda f: edit_index(f, _set("names", _names(key_shape=[4, 4], transpose=True))),
                              "has parameter names (names.params) that do not fit its tensors"),
    "string step": (lambda f: edit_index(f, _set("step", "4")), "step is '4', not a whole number >= 0"),
    "negative step": (lambda f: edit_index(f, _set("step", -1)), "step is -1, not a whole number >= 0"),
    "missing tensors": (lambda f: edit_index(f, lambda i: i.pop("tensors")), "tensors is missing"),
    "string lr": (lambda f: edit_index(f, _set("config.lr", "1e-3")), "config.lr is '1e-3', not a finite number"),
    "huge world": (lambda f: edit_index(f, _set("world", 10**15)), "lists rank-00001.safetensors, which is missing"),
    "huge shape": (lambda f: edit_index(f, lambda i: next(iter(i["tensors"].values())).update(shape=[10**12])),
                   "elements; its shape [1000000000000] has 1000000000000"),
    "missing optimizer": (lambda f: edit_index(f, lambda i: i.pop("optimizer")), "optimizer is missing"),
    "block not a list": (lambda f: edit_index(f, lambda i: _first_piece(i).update(block="0:64")), ".block is '0:64'"),
    "dotdot path": (lambda f: edit_index(f, lambda i: _first_piece(i).update(file="../../../etc/passwd")),
                    ".file is '../../../etc/passwd', not a file of the checkpoint's folder"),
    "absolute path": (lambda f: edit_index(f, lambda i: _first_piece(i).update(file="/etc/passwd")),
                      ".file is '/etc/passwd'"),
    "link out": (_outside_link, f"has {SHARD} as a symlink to"),
    "truncated": (_truncate, f"has {SHARD} of "),
    "truncated, no digests": (_truncate_unchecked, f"has {SHARD}, which is not a readable safetensors"),
    "garbage header": (lambda f: _header(f, b"\xff" * 8), f"has {SHARD}, which is not a readable safetensors"),
    "huge header": (lambda f: _header(f, (2**62).to_bytes(8, "little")), f"has {SHARD}"),
    "flipped bytes": (_flip, f"has {SHARD} whose bytes changed since it was saved"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_field(tree: Path, capsys, case: str) -> None:
    damage, message = DAMAGE[case]
    damage(tree / "ck" / STEP4)
    err = refused(["export", "ck", "-o", "model.safetensors"], capsys, tree)
    assert message in err and str(Path("ck") / STEP4) in err
    hint = err.split("hint: ", 1)[1]
    assert STEP2 in hint and STEP4 not in hint and "--resume ck " not in hint + " "  # never the damaged one


@pytest.mark.parametrize("case", ["string lr", "flipped bytes", "link out"])
def test_resuming_a_damaged_checkpoint_is_exit_2_and_creates_no_log(tree: Path, capsys, case: str) -> None:
    DAMAGE[case][0](tree / "ck" / STEP4)
    err = refused([*TRAIN, "--steps", "6", "--resume", "ck", "--log", "new.jsonl"], capsys, tree)
    assert DAMAGE[case][1] in err and not (tree / "new.jsonl").exists()


def test_a_checkpoint_without_digests_is_read_unchecked_with_a_note(tree: Path, capsys) -> None:
    edit_index(tree / "ck" / STEP4, lambda i: i.pop("files"))
    assert main(["export", "ck", "-o", "model.safetensors"]) == 0
    assert "records no digests" in capsys.readouterr().out


# The fields a reader uses, and what a JSON value of another kind there must be refused.
FIELDS = ["step", "world", "val_loss", "best", "best.step", "best.val_loss", "data.train", "config", "config.lr",
          "config.steps", "config.seed", "config.min_lr", "optimizer", "optimizer.steps_taken", "optimizer.lr",
          "plan", "plan.hash", "plan.zero", "plan.mesh", "names", "tensors", "T", "T.dtype", "T.shape", "T.dims",
          "T.pieces", "P", "P.file", "P.key", "P.block", "P.flat", "files", "F", "F.sha256", "F.bytes"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3), max_leaves=6)


def _kind(value) -> str:
    if value is None or isinstance(value, (bool, str, list, dict)):
        return type(value).__name__
    return "number" if isinstance(value, float) or abs(value) > 2**63 else "int"


def _node(index: dict, path: str, key: str) -> tuple[dict, str]:
    """The object holding the field `path` (T: a tensor's entry, P: its first piece, F: a file's digest)."""
    starts = {"T": (index["tensors"], key), "P": (index["tensors"][key]["pieces"], 0), "F": (index["files"], SHARD)}
    parts = path.split(".")
    node, last = starts.get(parts[0], (index, parts[0]))
    for name in parts[1:]:
        node, last = node[last], name
    return node, last


@st.composite
def mutations(draw):
    how = draw(st.sampled_from(["field", "field", "bytes", "truncate", "piece path"]))
    if how == "field":
        return how, draw(st.sampled_from(FIELDS)), draw(JSON)
    if how == "piece path":
        name = draw(st.sampled_from(["../../../etc/passwd", "/etc/passwd", "../rank-00000.safetensors", "",
                                     "sub/rank-00000.safetensors", "rank-00000.safetensors/..", "."]) | st.text())
        return how, None, name
    return how, None, draw(st.integers(0, 10**9))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations(), tensor=st.integers(0, 10**6))
def test_mutated_checkpoints_are_exit_2_or_harmless(saved: Path, capsys, mutation, tensor: int) -> None:
    """Whatever is changed, export ends 0 or 2, never 3/4 or a traceback; a value of another
    kind in a field the reader uses, changed shard bytes and a piece path other than the
    rank's own file are always 2, and a refusal writes nothing."""
    how, path, value = mutation
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "ck" / STEP4
        shutil.copytree(saved / "ck" / STEP4, folder)
        index = json.loads((folder / "index.json").read_text())
        key = sorted(index["tensors"])[tensor % len(index["tensors"])]
        must_refuse = _mutate(folder, index, key, how, path, value)
        out = Path(scratch) / "model.safetensors"
        code = main(["export", str(folder), "-o", str(out)])
        err = capsys.readouterr().err
        assert code in (0, 2) and "Traceback" not in err and "internal error" not in err
        assert (code == 2) == (not out.exists())
        event(f"{how}: exit {code}{' (must refuse)' if must_refuse else ''}")
        if must_refuse:
            assert code == 2 and str(folder) in err, (how, path, value)


def _mutate(folder: Path, index: dict, key: str, how: str, path: str | None, value) -> bool:
    """Apply one mutation; whether it must be refused."""
    if how in ("bytes", "truncate"):
        data = bytearray((folder / SHARD).read_bytes())
        at = value % len(data)
        if how == "bytes":
            data[at] ^= 1 + value % 255
        (folder / SHARD).write_bytes(bytes(data if how == "bytes" else data[:at]))
        return True
    if how == "piece path":
        index["tensors"][key]["pieces"][0]["file"] = value
        must = value != SHARD
    else:
        node, last = _node(index, path, key)
        old = node[last] if isinstance(node, dict) and last in node else None
        must = value is not None and _kind(old) != _kind(value) and not (_kind(old) == "int" and
                                                                      _kind(value) == "number" and path == "val_loss")
        must = must and not (_kind(old) == "number" and _kind(value) == "int")
        node[last] = value
    (folder / "index.json").write_text(json.dumps(index))
    return must


# ---- leftovers -------------------------------------------------------------------------------
def test_sigterm_removes_the_runs_temp_folders(tree: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(scratch))
    proc = subprocess.Popen([sys.executable, "-m", "fivedc.cli.main", *TRAIN, "--steps", "1000000", "--save-dir",
                             "term"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(scratch.glob(f"fivedc-pool-{proc.pid}-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert list(scratch.glob(f"fivedc-train-{proc.pid}-*"))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and list(scratch.iterdir()) == []


def test_a_rank_refusing_the_resumed_checkpoint_is_not_told_to_resume_from_it(saved: Path) -> None:
    """The hint a failed run gets names its save directory's last checkpoint, unless that
    is the very checkpoint it resumed from and the failure is bad input (exit 2)."""
    from types import SimpleNamespace

    from fivedc.cli.train_launch import with_resume_hint as _with_resume_hint
    from fivedc.errors import FivedcError

    job = SimpleNamespace(save_dir=str(saved / "ck"), resume=str(saved / "ck" / STEP4))
    bad, crash = FivedcError("a piece is missing", hint="h"), FivedcError("rank 1 died")
    crash.exit_code = 3
    assert _with_resume_hint(bad, job).hint == "h"
    assert f"continue with --resume {saved / 'ck'}" in _with_resume_hint(crash, job).hint
    earlier = SimpleNamespace(save_dir=str(saved / "ck"), resume=str(saved / "ck" / STEP2))
    assert "continue with --resume" in _with_resume_hint(FivedcError("a piece is missing"), earlier).hint


def test_a_save_of_non_finite_state_is_refused(saved: Path, tmp_path: Path, monkeypatch) -> None:
    """Should a NaN reach the parameters with a finite loss, the save refuses it (every
    rank agrees by one all-reduce) and leaves no committed checkpoint."""
    from fivedc.runtime import checkpoint

    real = checkpoint.rank_pieces

    def poisoned(run):
        tensors, pieces = real(run)
        name = next(k for k in sorted(tensors) if k.startswith("param/"))
        tensors[name] = torch.full_like(tensors[name], math.inf)
        return tensors, pieces

    monkeypatch.setattr(checkpoint, "rank_pieces", poisoned)
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1", dtype="fp32"),
                                      (str(saved / "train.bin"), str(saved / "val.bin")), steps=2, save_every=1),
                              save_dir=str(tmp_path / "ck"))
    with pytest.raises(NonFiniteError, match="step 1's state holds NaN or infinite values"):
        one_device(job)
    assert committed(tmp_path / "ck") == [] and not (tmp_path / "ck" / "best_model.safetensors").exists()
