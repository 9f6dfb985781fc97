"""The README's "Use" and "Training" commands work as printed, in order.

`readme_commands` takes the ```sh blocks of those two sections, joins the lines a `\\`
continues, splits `&&` chains and reads the exit code a line's comment promises
(`# ... exit 1`; else 0). Each command runs in one temporary directory (where
`examples/` links to the repository's), `fivedc` in this process (`main`), with a terminal
wider than fivedc prints by default: it must exit as promised and print lines of at most
100 columns with no trailing spaces. A torchrun line needs several machines, and a
`--launcher ray` line a Ray cluster: their fivedc command is parsed (every flag must still
exist) but not run (tests/test_ray_launcher.py runs the Ray launcher). Variables set before
a line's program (`NAME=value torchrun ...`) are not part of its command. A README line too
slow for this test is made cheaper in the README, never skipped here. The README's test
command is `.ci/run`'s, word for word.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fivedc.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("Use", "Training")


@dataclass(frozen=True, slots=True)
class Command:
    argv: tuple[str, ...]
    exit_code: int
    line: str  # as the README prints it, for messages


def section(text: str, title: str) -> str:
    """The README's `## title` section, its subsections included."""
    match = re.search(rf"^## {re.escape(title)}\b.*?(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(0)


def readme_commands(text: str) -> list[Command]:
    commands = []
    for title in SECTIONS:
        for block in re.findall(r"^```sh\n(.*?)^```", section(text, title), flags=re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                promised = re.search(r"#.*\bexit (\d)\b", line)
                tokens = shlex.split(line, comments=True)
                while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # the line's environment
                    tokens = tokens[1:]
                while tokens:
                    end = tokens.index("&&") if "&&" in tokens else len(tokens)
                    commands.append(Command(tuple(tokens[:end]), int(promised.group(1)) if promised else 0, line))
                    tokens = tokens[end + 1:]
    return commands


def test_the_readme_has_its_commands() -> None:
    commands = readme_commands((ROOT / "README.md").read_text())
    programs = {c.argv[0] for c in commands}
    assert programs == {"fivedc", "python", "torchrun"}, programs
    assert any(c.exit_code == 1 for c in commands)  # the checker's self-test
    assert not any("[" in arg for c in commands for arg in c.argv), "a README line prints an optional flag as [...]"


def fivedc_argv_under_torchrun(argv: tuple[str, ...]) -> list[str]:
    at = argv.index("fivedc.cli.main")
    rest = list(argv[at + 1:])
    return rest[1:] if rest[:1] == ["--"] else rest


def run_fivedc(args: list[str], capsys) -> tuple[int, str, str]:
    """A fivedc command in this process (torch and fivedc imported once for every line)."""
    try:
        code = main(args)
    except SystemExit as exit:  # --version, --help
        code = exit.code if isinstance(exit.code, int) else 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_readme_commands_work_as_printed(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    for command in readme_commands((ROOT / "README.md").read_text()):
        program, *args = command.argv
        if program == "torchrun":  # several machines: the command must parse
            build_parser().parse_args(fivedc_argv_under_torchrun(command.argv))
            continue
        if program == "fivedc" and "ray" in command.argv and "--launcher" in command.argv:  # a Ray cluster
            build_parser().parse_args(args)
            continue
        if program == "fivedc":
            code, out, err = run_fivedc(args, capsys)
        else:
            done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
            code, out, err = done.returncode, done.stdout, done.stderr
        assert code == command.exit_code, (
            f"README line {command.line!r} exited {code}, not {command.exit_code}:\n{out[-3000:]}\n{err[-3000:]}")
        if program == "fivedc":
            for line in out.splitlines():
                assert len(line) <= 100 and line == line.rstrip(), f"{command.line!r} printed {line!r}"


def test_ci_runs_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"runs the tests \(what CI runs\):\n\n```sh\n(.*?)\n```", readme, flags=re.S)
    assert match, "README.md no longer shows the test command CI runs"
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    ci = [line for line in script.splitlines() if line.startswith("pip install")]
    assert len(ci) == 1 and " ".join(ci[0].split()) == " ".join(match.group(1).split())
