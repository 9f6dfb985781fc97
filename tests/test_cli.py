"""The command line: help, exit codes, errors with carets and no tracebacks, files.

Most cases call `fivedc.cli.main.main` in-process; one runs the installed `fivedc`
entry point to check the real exit code and stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fivedc.cli.main import main
from fivedc.plan.execution_plan import ExecutionPlan

BAD_MODEL = """model broken {
  dims { batch = 2 seq = 4 }
  input tokens: int[batch, seq]
  x = embeding(tokens, w)
  return x
}
"""


def test_help_lists_every_command(capsys) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("compile", "verify", "diff"):
        assert command in out


def test_version_prints_the_package_version(capsys) -> None:
    import fivedc

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fivedc {fivedc.__version__}"
    done = subprocess.run([sys.executable, "-m", "fivedc", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"fivedc {fivedc.__version__}"


def test_compile_writes_plan_and_summary(tmp_path, capsys) -> None:
    out = tmp_path / "gpt.plan.json"
    assert main(["compile", "examples/gpt.5d", "--mesh", "dp=2,tp=2", "--sp", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reduce_scatter" in text and "all_gather" in text and out.exists()
    assert json.loads(out.read_text())["version"] == 1


def test_bad_model_points_at_the_line_and_writes_nothing(tmp_path, capsys) -> None:
    model = tmp_path / "broken.5d"
    model.write_text(BAD_MODEL)
    out = tmp_path / "broken.plan.json"
    assert main(["compile", str(model), "--mesh", "1x1x1x1x1", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model}:4:7: error" in err and "embeding" in err and "^" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("mesh,message", [
    ("2x2", "cannot parse mesh '2x2'"),
    ("dp=2,xp=2", "unknown mesh axis 'xp'"),
    ("1x1x3x1x1", "vocab=64 is not divisible by tp=3"),
    ("1x8x1x1x1", "the model has 4 layers and op groups but the pipeline needs 8 chunks"),
])
def test_bad_meshes(mesh: str, message: str, capsys) -> None:
    assert main(["compile", "examples/gpt.5d", "--mesh", mesh, "-q", "-o", "/dev/null"]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_diff_plan_file_against_model_at_mesh(tmp_path, capsys) -> None:
    plan = tmp_path / "a.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x1x2x1x1", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["diff", str(plan), "examples/tiny_llama.5d@2x1x2x1x1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert main(["diff", str(plan), "examples/tiny_llama.5d@2x1x1x1x1", "--json"]) == 0
    changed = json.loads(capsys.readouterr().out)
    assert changed["identical"] is False and changed["params"]


def test_verify_refuses_a_launcher_world_that_does_not_match(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["verify", "examples/gpt.5d", "--mesh", "2x1x2x1x1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "needs 4 processes" in err and "8" in err


def test_installed_entry_point_exit_code_and_stderr(tmp_path) -> None:
    model = tmp_path / "broken.5d"
    model.write_text(BAD_MODEL)
    result = subprocess.run([sys.executable, "-m", "fivedc.cli.main", "compile", str(model), "--mesh", "1x1x1x1x1"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert "broken.5d:4:7" in result.stderr and "Traceback" not in result.stderr


def test_cp_options_choose_the_variant_and_layout(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    args = ["compile", "examples/tiny_llama.5d", "--mesh", "1x1x1x2x1", "-o", str(out)]
    assert main(args + ["--cp-attention", "allgather", "--cp-layout", "contiguous"]) == 0
    text = capsys.readouterr().out
    assert "contiguous: the sequence in 2 chunks" in text and "attention: allgather ×2" in text
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "balanced: the sequence in 4 chunks" in text and "attention: ring ×2" in text and "send_recv" in text


def test_cp_that_does_not_divide_the_sequence_is_a_clear_error(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x1x3x1", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "seq=8 is not divisible by 6" in err and "examples/tiny_llama.5d:8:" in err
    assert "choose cp in {1, 2, 4}" in err and "Traceback" not in err and not out.exists()
    with pytest.raises(SystemExit):
        main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x1x2x1", "--cp-attention", "rign"])


def test_compile_and_verify_a_python_module_factory(tmp_path, capsys) -> None:
    out = tmp_path / "nanogpt.plan.json"
    assert main(["compile", "examples/nanogpt.py:factory", "--mesh", "2x1x2x1x1", "--sp", "-q", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["graph"]["name"]
    assert main(["verify", "examples/llama.py:factory", "--mesh", "1x2x2x1x1", "--zero", "2"]) == 0
    assert "OK: tolerance 1e-10" in capsys.readouterr().out
    marked = tmp_path / "marked.plan.json"
    assert main(["compile", "examples/nanogpt.py:factory", "--mesh", "1x2x1x1x1", "--stage-boundary", "transformer.h.1",
                 "-q", "-o", str(marked)]) == 0
    chunks = ExecutionPlan.load(marked).pipeline.chunks
    assert [c.what for c in chunks] == ["embedding+add, layers.0", "layers.1, layernorm+linear+cross_entropy"]
    capsys.readouterr()
    assert main(["compile", "examples/gpt.5d", "--mesh", "1x2x1x1x1", "--stage-boundary", "layers.1"]) == 2
    assert "is a DSL model" in " ".join(capsys.readouterr().err.split())
    assert main(["compile", "examples/missing.py:factory", "--mesh", "2x1x1x1x1", "-o", str(out)]) == 2
    assert "examples/missing.py does not exist" in " ".join(capsys.readouterr().err.split())


def test_run_executes_a_saved_plan_and_a_model(tmp_path, capsys) -> None:
    """`fivedc run`: the plan's program trains (the loss falls), every step is timed, and
    what a rank holds is the plan's estimate; a saved plan keeps its mesh and options."""
    saved = tmp_path / "gpt.plan.json"
    assert main(["compile", "examples/gpt.5d", "--mesh", "2x2x1x1x1", "--zero", "1", "--dtype", "fp32", "-q",
                 "-o", str(saved)]) == 0
    capsys.readouterr()
    report = tmp_path / "report.json"
    assert main(["run", str(saved), "--steps", "3", "--lr", "1e-2", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.fullmatch(r"\s*\d+\s+[-\d.]+\s+[\d.]+", line)]  # step loss ms
    losses = [float(row[1]) for row in rows]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
    plan = ExecutionPlan.load(saved)
    from fivedc.plan.summary import format_bytes

    for kind in ("params", "grads", "optimizer", "activations"):
        held = next(line for line in out.splitlines() if line.strip().startswith(kind))
        assert held.split(None, 1)[1].count(format_bytes(getattr(plan.memory, kind))) == 2, held
    data = json.loads(report.read_text())  # per rank: the estimate of its class and what it measured
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3] and data["device"] == "cpu"
    for entry in data["ranks"]:
        estimated, measured = entry["estimated"], entry["measured"]
        assert set(estimated) == set(measured) == {"params", "grads", "optimizer", "activations", "transient", "total"}
        assert all(measured[k] == estimated[k] for k in ("params", "grads", "optimizer", "activations"))
        assert measured["total"] is None  # no allocator peak on CPU
    assert main(["run", "examples/tiny_llama.5d", "--mesh", "1x1x2x1x1", "--sp", "--steps", "2"]) == 0
    assert "on mesh 1x1x2x1x1 (2 processes, 2 steps, fp32" in capsys.readouterr().out
    assert main(["run", str(saved), "--zero", "2", "--mesh", "4x1x1x1x1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--mesh, --zero would change them" in err and "Traceback" not in err
    assert main(["run", "examples/gpt.5d"]) == 2
    assert "needs a mesh" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags,message", [
    (["--schedule", "nosuch"], "unknown pipeline schedule 'nosuch'"),
    (["--microbatches", "0"], "microbatches 0 must be an integer >= 1"),
    (["--pp-layout", "7,7,7"], "--pp-layout sets up a pipeline, but mesh 1x1x1x1x1 has pp=1"),
    (["--schedule", "gpipe"], "--schedule sets up a pipeline, but mesh 1x1x1x1x1 has pp=1"),
    (["--bucket-mb", "inf"], "bucket size inf MiB must be > 0 and finite"),
    (["--bucket-mb", "nan"], "bucket size nan MiB must be > 0 and finite"),
])
def test_settings_that_mean_nothing_are_refused(flags, message, tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["compile", "examples/gpt.5d", "--mesh", "1x1x1x1x1", "-q", "-o", str(out), *flags]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err and not out.exists()


def test_run_cannot_measure_inside_compiled_regions(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    assert main(["run", "examples/gpt.5d", "--mesh", "1x1x1x1x1", "--compile", "--report", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "compiled regions hide" in err and "Traceback" not in err and not out.exists()


def test_a_world_the_machine_cannot_run_is_refused_before_any_process(tmp_path, capsys) -> None:
    import multiprocessing

    plan = tmp_path / "big.json"
    assert main(["compile", "examples/llama3_405b.5d", "--mesh", "2048x1x8x1x1", "--sp", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    before = set(multiprocessing.active_children())
    assert main(["run", str(plan)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "needs 16384 local processes" in err and "--force" in err and "torchrun" in err
    assert set(multiprocessing.active_children()) == before
    assert main(["verify", "examples/deepseek_v3.5d", "--mesh", "1x1x1x1x2"]) == 2
    assert "of memory" in " ".join(capsys.readouterr().err.split())


def test_a_half_set_launcher_environment_is_bad_input(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main(["verify", "examples/gpt.5d", "--mesh", "1x1x1x1x1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "MASTER_ADDR and MASTER_PORT are not" in err and "torchrun" in err


def test_an_internal_error_is_one_line_and_exit_4(monkeypatch, capsys) -> None:
    import fivedc.cli.main as cli

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "cmd_check", broken)
    assert main(["check", "whatever.json"]) == 4
    err = " ".join(capsys.readouterr().err.split())
    assert "internal error in fivedc (ZeroDivisionError: a bug)" in err and "Traceback" not in err
    assert "0 ok" in subprocess.run([sys.executable, "-m", "fivedc.cli.main", "--help"], capture_output=True,
                                    text=True).stdout.replace("  ", " ")
