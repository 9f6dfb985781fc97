"""Every command's output fits 100 columns by default, with no trailing spaces.

Each command runs in-process on a cheap example with `COLUMNS=300` (a terminal wider than
the default allows): compile (a pipeline plan with --gpu), check --collectives, show --ops,
diff of two model@mesh pairs, search, train (one process, a few steps) and export. Every
line it prints must be at most 100 columns and end without a space; `--wide` may go wider.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fivedc.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
GPT, TINY = str(ROOT / "examples" / "gpt.5d"), str(ROOT / "examples" / "tiny_llama.5d")


def printed(capsys, argv: list[str], *, code: int = 0) -> list[str]:
    assert main(argv) == code, argv
    return capsys.readouterr().out.splitlines()


def assert_fits(lines: list[str], command: str) -> None:
    assert lines, f"{command} printed nothing"
    for number, line in enumerate(lines, 1):
        assert len(line) <= 100, f"{command}, line {number}: {len(line)} columns: {line!r}"
        assert line == line.rstrip(), f"{command}, line {number} ends with a space: {line!r}"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")


def test_plan_commands_fit_100_columns(tmp_path, capsys) -> None:
    plan = str(tmp_path / "p.json")
    commands = [
        ["compile", GPT, "--mesh", "1x2x2x1x1", "--schedule", "zb-h1", "--microbatches", "4", "--gpu", "h100",
         "-o", plan],
        ["compile", GPT, "--mesh", "2x1x2x1x1", "--sp", "--passes", "-o", str(tmp_path / "q.json")],
        ["check", plan, "--collectives"],
        ["show", plan, "--ops"],
        ["diff", f"{GPT}@2x1x2x1x1", f"{GPT}@1x1x4x1x1"],
        ["search", GPT, "--gpus", "64", "--gpu", "h100", "--top", "5", "--explain", "-o", str(tmp_path / "best.json"),
         "--json", str(tmp_path / "all.json")],
        ["search", GPT, "--gpus", "64", "--gpu", "h100", "--explain", "--compare", "4x4x4x1x1", "--schedule", "1f1b",
         "--microbatches", "1", "--recompute", "full"],
        ["search", GPT, "--gpus", "64", "--gpu", "h100", "--fp8", "--explain", "--compare", "4x4x4x1x1"],
    ]
    for argv in commands:
        assert_fits(printed(capsys, argv), " ".join(argv[:1]))


def test_wide_tables_may_use_more(tmp_path, capsys) -> None:
    plan = str(tmp_path / "p.json")
    printed(capsys, ["compile", GPT, "--mesh", "2x1x2x1x1", "--sp", "-q", "-o", plan])
    assert max(map(len, printed(capsys, ["show", plan, "--ops", "--wide"]))) > 100
    assert max(map(len, printed(capsys, ["diff", f"{GPT}@2x1x2x1x1", f"{GPT}@1x1x4x1x1", "--wide"]))) > 100


def test_train_and_export_fit_100_columns(tmp_path, capsys) -> None:
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_data.py"), str(tmp_path / "data")], check=True,
                   capture_output=True)
    ckpt = str(tmp_path / "ckpt")
    lines = printed(capsys, ["train", TINY, "--mesh", "1x1x1x1x1", "--data", str(tmp_path / "data" / "train.bin"),
                             "--val", str(tmp_path / "data" / "val.bin"), "--steps", "2", "--save-dir", ckpt])
    assert lines[0].startswith("training ")
    assert_fits(lines, "train")
    assert_fits(printed(capsys, ["export", ckpt, "-o", str(tmp_path / "model.safetensors")]), "export")


def test_a_long_command_line_is_broken_where_the_shell_joins_it() -> None:
    import shlex

    from fivedc.cli.screen import command_line

    text = "fivedc compile " + " ".join(f"--flag-{i} value-{i}" for i in range(20))
    lines = command_line(text, width=60).split("\n")
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert shlex.split(" ".join(line.removesuffix("\\") for line in lines)) == shlex.split(text)


def test_a_rich_table_loses_its_padding(capsys) -> None:
    from rich.table import Table

    from fivedc.cli.screen import console

    table = Table("a", "b", box=None)  # rich pads the last column to its width
    table.add_row("x", "a longer cell")
    table.add_row("a longer cell", "y")
    console().print(table)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line == line.rstrip() for line in lines)


def failed(capsys, argv: list[str], *, code: int = 2) -> list[str]:
    """The lines a failing command writes to stderr: its exit code as before, no traceback."""
    assert main(argv) == code, argv
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not captured.out, argv
    return captured.err.splitlines()


def test_a_long_error_fits_100_columns_with_its_location_whole(tmp_path, capsys) -> None:
    """A located error in a long-named file, at column 133 of a long line: the message and the
    hint wrap at spaces (continuation lines indented), `path:line:col` stays on one line, and
    the source line shows the part around the column with the caret under it."""
    room = 92 - len(str(tmp_path)) - len("/model.5d:21:133:")
    folder = tmp_path / ("a_folder_with_a_long_name_" * 4)[:max(room, 1)]
    folder.mkdir()
    model = folder / "model.5d"
    line = "  x = embedding(tokens, wte)         # no position embedding: rope adds positions"
    text = Path(TINY).read_text()
    assert line in text
    model.write_text(text.replace(line, " " * 110 + "x = embedding(tokens, wtf)  # " + "a long comment " * 9))
    lines = failed(capsys, ["compile", str(model), "--mesh", "1x1x1x1x1"])
    assert_fits(lines, "compile's error")
    assert lines[0].startswith(f"{model}:21:133:"), lines
    assert "undefined name 'wtf'" in " ".join(lines[:2]) and "hint: did you mean 'wte'?" in lines
    caret = next(k for k, text in enumerate(lines) if text.strip() == "^")
    column = lines[caret].index("^")
    assert lines[caret - 1][column:column + 3] == "wtf" and lines[caret - 1].lstrip().startswith("...")


def test_a_long_message_without_a_location_wraps_and_loses_nothing(capsys) -> None:
    argv = ["compile", GPT, "--mesh", "1x1x1x1x1", "--microbatches", "3", "--schedule", "dualpipev"]
    lines = failed(capsys, argv)
    assert_fits(lines, "compile's error")
    assert len(lines) > 2 and lines[1].startswith("  ") and not lines[1].startswith("   ")
    joined = " ".join(text.strip() for text in lines)
    assert ("error: --schedule, --microbatches set up a pipeline, but mesh 1x1x1x1x1 has pp=1: there is none, "
            "and the flag would change nothing") in joined
    assert "hint: drop the flag, or give the mesh a pipeline axis, e.g. --mesh 1x2x1x1x1" in joined
