"""The top level is the design card's (`pyproject.toml, fivedc/, grammars/, passes/, runtime/,
tests/, examples/`), and an install puts all of it in the one namespace: `passes/` is
`fivedc.passes`, `runtime/` is `fivedc.runtime`, the grammars are package data of
`fivedc.grammars`, and no bare `passes`, `runtime` or `grammars` module is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import fivedc

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("fivedc", *fivedc.TOP_LEVEL.values())


def test_the_top_level_is_the_design_cards():
    assert {"pyproject.toml", "fivedc", "grammars", "passes", "runtime", "tests", "examples"} \
        <= {p.name for p in ROOT.iterdir()}
    assert not any((ROOT / "fivedc" / name).exists() for name in fivedc.TOP_LEVEL.values())


def test_pyproject_installs_every_folder_into_the_one_namespace():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {name: folder for name, folder in fivedc.TOP_LEVEL.items()}
    folders = {"fivedc": ROOT / "fivedc", **{name: ROOT / folder for name, folder in fivedc.TOP_LEVEL.items()}}
    found = {".".join([name, *p.parent.relative_to(folder).parts])
             for name, folder in folders.items() for p in folder.rglob("__init__.py")}
    assert sorted(tool["packages"]) == sorted(found), "a package folder pyproject.toml does not list (or one gone)"
    assert all(name == "fivedc" or name.startswith("fivedc.") for name in tool["packages"])


def test_the_modules_are_found_in_the_top_level_folders():
    import fivedc.grammars
    import fivedc.passes
    import fivedc.runtime

    assert Path(fivedc.passes.__file__).parent.name == "passes"
    assert Path(fivedc.runtime.__file__).parent.name == "runtime"
    assert Path(fivedc.grammars.__file__).parent.name == "grammars"


def test_a_wheel_installs_nothing_outside_the_fivedc_namespace(tmp_path):
    source = tmp_path / "source"
    for name in SOURCES:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fivedc"}
    for part in ("fivedc/passes/stages.py", "fivedc/runtime/program.py", "fivedc/grammars/fivedc.lark",
                 "fivedc/ir/hardware.toml"):
        assert part in names
