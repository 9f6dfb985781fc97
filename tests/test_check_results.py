"""benchmarks/check_results.py: the deterministic figures of the README and RESULTS.md hold, and
the check can fail: a wrong figure is drift (exit 1), a figure it cannot find is an error (exit 2)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from check_results import main  # noqa: E402


def copy_of_the_documents(tmp_path: Path) -> Path:
    (tmp_path / "benchmarks").mkdir()
    for name in ("README.md", "benchmarks/RESULTS.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_every_figure_holds(capsys) -> None:
    assert main([]) == 0, capsys.readouterr().out


def test_a_wrong_figure_fails_and_write_puts_it_right(tmp_path, capsys) -> None:
    root = copy_of_the_documents(tmp_path)
    readme = root / "README.md"
    right = readme.read_text()
    assert right.count("# Llama 3's layout: fits, 73.3 GiB") == 1
    readme.write_text(right.replace("# Llama 3's layout: fits, 73.3 GiB", "# Llama 3's layout: fits, 71.3 GiB"))
    assert main(["--root", str(root), "--only", "readme-llama3-fits"]) == 1
    assert "DRIFT readme-llama3-fits" in capsys.readouterr().out
    assert main(["--root", str(root), "--only", "readme-llama3-fits", "--write"]) == 0
    assert readme.read_text() == right


def test_a_figure_it_cannot_find_is_an_error(tmp_path, capsys) -> None:
    root = copy_of_the_documents(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("activations per rank", "activations"))
    assert main(["--root", str(root), "--only", "readme-recompute"]) == 2
    assert "README.md has 0 matches" in " ".join(capsys.readouterr().err.split())
