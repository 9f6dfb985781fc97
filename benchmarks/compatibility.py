"""The compatibility matrix: models written by others, compiled and verified on each layout.

For every architecture in `examples/hf_models.py` (Hugging Face transformers, tiny
configs, random init), and in `examples/titan_tune_models.py` (torchtitan and torchtune,
when both are installed: its docstring says how, without moving torch), and each layout of the matrix (1x1x1x1x1, dp2·tp2, cp2, pp2
with 1F1B, dp2 with ZeRO-3, and ep2 for mixture-of-experts models), this compiles
and verifies the model with `fivedc verify ...:ARCH --mesh ...` (2 AdamW steps against
the plain module; a model it cannot compile exits 2 with the compile error). A cell is `ok` with the
largest relative error, or the first error: its message and the user's file:line.
The table goes to stdout and, with `--write`, to `docs/compatibility.md`: each row, once
measured, replaces its row in `docs/compatibility.json` (every row's cells and the library
versions that gave them), and the doc is rendered from all of that file's rows, so a run of
a few architectures updates theirs and keeps the others, and a run stopped early keeps the
rows it finished.

    python benchmarks/compatibility.py [--write] [--arch llama --arch gpt2] [--dtype fp64] [--loss logits]

Every row verifies in `--dtype`; five architectures also run under a training loop's
own logits loss (`examples/hf_models.LogitsLoss`). The last column counts the ops that
run replicated (no sharding rule: parallelism lost there), by ATen operator; ATen ops
that run on shards (pointwise, reductions, slices) are not counted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {  # column -> (mesh, extra flags)
    "1 rank": ("1x1x1x1x1", []),
    "dp2·tp2": ("2x1x2x1x1", []),
    "cp2": ("1x1x1x2x1", []),
    "pp2 1f1b": ("1x2x1x1x1", ["--schedule", "1f1b"]),
    "dp2 ZeRO-3": ("2x1x1x1x1", ["--zero", "3"]),
    "ep2": ("1x1x1x1x2", []),
}
MOE = {"mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "granitemoe", "qwen2_moe", "titan_qwen3_moe_sdpa", "titan_deepseek_v3",
       "titan_deepseek_v3_sdpa"}
SOURCES = ("hf_models.py", "titan_tune_models.py", "x_transformers_models.py")  # in examples/: each lists its ARCHITECTURES
LOGITS_ROWS = ("llama", "mistral", "qwen2", "qwen3", "mixtral")  # also run under a loop's own logits loss
WINDOW_ROWS = ("gemma2", "mistral", "gemma3")  # also with a sliding window shorter than the sequence


def replicated_cell(source: str, arch: str) -> str:
    """The ops of the traced model that run replicated: `3 (pad, slice, cumsum)`, or `-`."""
    from collections import Counter

    from fivedc.ir.aten_call import whole_dims
    from fivedc.cli.main import load_graph
    from fivedc.errors import FivedcError
    from fivedc.ir.graph import Op, walk_ops

    try:
        graph = load_graph(f"{ROOT}/examples/{source}:{arch}")
    except FivedcError:
        return "-"
    names = Counter(str(op.attr("target")).split(".")[1] for op, repeat in walk_ops(graph.body)
                    if isinstance(op, Op) and op.kind == "aten" and whole_dims(op) is None)
    if not names:
        return "0"
    return f"{sum(names.values())} (" + ", ".join(f"{n}×{k}" if k > 1 else n for n, k in names.most_common()) + ")"


def verify_cell(source: str, arch: str, mesh: str, flags: list[str], dtype: str) -> str:
    """`fivedc verify` in a fresh process (it starts its own ranks): 'ok 1.2e-13', or 'compile: ERROR'
    (exit 2: it did not compile), or the mismatch."""
    run = subprocess.run([sys.executable, "-m", "fivedc.cli.main", "verify", f"{ROOT}/examples/{source}:{arch}",
                          "--mesh", mesh, *flags, "--dtype", dtype], capture_output=True, text=True, timeout=900)
    if run.returncode == 0:
        worst = max(float(line.split()[1]) for line in run.stdout.splitlines()
                    if line.strip().startswith(("loss ", "gradients ", "parameters ")))
        return f"ok {worst:.0e}"
    error = _first_error(run.stderr, run.returncode)
    return f"compile: {error}" if run.returncode == 2 else error


def _first_error(text: str, code: int) -> str:
    """The error a failed `fivedc verify` printed: its located message, or where a rank failed
    ("rank 0 of 1 failed in rank_job:" and the rank's traceback) the exception that ended it."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[transformers]")]
    head = next((line for line in lines if "error:" in line), lines[0] if lines else f"exit {code}")
    if " failed in " in head:
        raised = [line.strip() for line in lines if re.match(r"\s*[\w.]*(Error|Exception)\b.*: ", line)]
        head = raised[-1] if raised else head
    where, _, message = head.partition(": error: ")
    if not message:
        return head.removeprefix("error: ")
    site = where.split("site-packages/")[-1]
    return f"{message} ({site})"


def matrix(archs: list[tuple[str, str]], dtype: str, done=lambda row, cells: None,
           losses: tuple[str, ...] = ("library", "logits"), windows: tuple[str, ...] = WINDOW_ROWS) -> dict[str, dict[str, str]]:
    """Each (source file, architecture) with the library's loss, then those of LOGITS_ROWS under
    `LogitsLoss` (of `losses`), then `windows` (of WINDOW_ROWS) with a window shorter than the sequence,
    all verified in `dtype`; `done(row, cells)` after each row."""
    runs = [(arch, source, arch, dtype) for source, arch in archs] if "library" in losses else []
    runs += [(f"{arch} (logits loss)", source, f"{arch}_logits", dtype) for source, arch in archs
             if source == SOURCES[0] and arch in LOGITS_ROWS and "logits" in losses]
    runs += [(f"{arch} (window 4 of 8)", SOURCES[0], f"{arch}_window", dtype) for arch in windows
             if "library" in losses]
    rows: dict[str, dict[str, str]] = {}
    for row, source, factory, row_dtype in runs:
        rows[row] = {}
        for column, (mesh, flags) in LAYOUTS.items():
            if column == "ep2" and factory.removesuffix("_logits").removesuffix("_window") not in MOE:
                rows[row][column] = "-"
                continue
            start = time.perf_counter()
            rows[row][column] = verify_cell(source, factory, mesh, flags, row_dtype)
            print(f"{row:24} {column:12} {time.perf_counter() - start:5.1f} s  {rows[row][column]}", flush=True)
        rows[row][REPLICATED] = replicated_cell(source, factory)
        done(row, rows[row])
    return rows


REPLICATED = "replicated ops"
CELLS = ROOT / "docs" / "compatibility.json"  # row -> {"cells": {column: cell}, "versions": ...}


def merged(measured: dict[str, dict[str, str]], versions: str, order: list[str] = ()) -> dict[str, dict]:
    """The rows of CELLS with those just measured put in their place, in `order` (the rows it
    does not name after those, as they were)."""
    rows = json.loads(CELLS.read_text()) if CELLS.exists() else {}
    for row, cells in measured.items():
        rows[row] = {"cells": cells, "versions": versions}
    place = {row: i for i, row in enumerate(order)}
    return {row: rows[row] for row in sorted(rows, key=lambda row: place.get(row, len(place)))}


def render(rows: dict[str, dict[str, str]], *, versions: str, dtype: str) -> str:
    """A model x layout table of short cells (`ok 1e-13`, `compile [2]`); each distinct
    error once, numbered, below it. `versions`: the libraries' versions that gave the rows."""
    columns = list(LAYOUTS) + [REPLICATED]
    errors: list[str] = []

    def cell(text: str) -> str:
        if text == "-" or text.startswith("ok") or text[:1].isdigit():
            return text
        stage, _, error = text.partition(": ") if text.startswith("compile: ") else ("verify", "", text)
        if error not in errors:
            errors.append(error)
        return f"{stage} [{errors.index(error) + 1}]"

    out = ["# Compatibility: models written by others", "",
           "Generated by `python benchmarks/compatibility.py --write` (do not edit by hand).",
           f"Libraries: {versions}. Each model is built from its library with a tiny config and random",
           "weights (`examples/hf_models.py`, `examples/titan_tune_models.py`: `titan_*`, `tune_*`, `examples/x_transformers_models.py`:",
           "`autoregressive`; a `(window 4 of 8)` row: `sliding_window` shorter than the sequence); a cell is `ok` with the largest relative error of `fivedc verify`",
           f"({dtype}, 2 AdamW steps against the plain module), or where it stops: at compile or at verify,",
           "with the first error (numbered below). The last column counts the ops that run replicated",
           "(no sharding rule: computed whole on every rank), by ATen operator; ATen ops that run on",
           "shards (pointwise, reductions, slices) are not counted.", "",
           "| model | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for arch, cells in rows.items():
        out.append(f"| {arch} | " + " | ".join(cell(cells[c]) for c in columns) + " |")
    out += ["", "These libraries compute RMSNorm, the rotary tables and the loss in float32 even inside a float64",
            "model; a plan computes at one dtype, so the float64 check reads those casts as float64 in the",
            "reference too (`fivedc/frontends/fx/precision.py`)."]
    out += ["", "Errors:", ""] + [f"{k}. {e}" for k, e in enumerate(errors, start=1)] if errors else []
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append",
                        help="architectures (default: all of examples/hf_models.py, and of "
                             "examples/titan_tune_models.py when torchtitan and torchtune are installed, and of "
                             "examples/x_transformers_models.py when x-transformers is); ARCH_window: its window row")
    parser.add_argument("--dtype", default="fp64", choices=("fp64", "fp32"))
    parser.add_argument("--loss", default="both", choices=("library", "logits", "both"),
                        help="the rows under the library's own loss, those under a logits loss, or both")
    parser.add_argument("--write", action="store_true",
                        help="write docs/compatibility.md and docs/compatibility.json, row by row")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "examples"))
    import importlib
    import importlib.metadata
    import importlib.util

    import torch

    libraries = {SOURCES[0]: ("transformers",), SOURCES[1]: ("torchtitan", "torchtune"), SOURCES[2]: ("x_transformers",)}
    installed = [s for s in SOURCES if all(importlib.util.find_spec(name) for name in libraries[s])]
    known = [(s, a) for s in installed for a in importlib.import_module(s.removesuffix(".py")).ARCHITECTURES]
    windows = tuple(a for a in WINDOW_ROWS if not args.arch or f"{a}_window" in args.arch)
    unknown = set(args.arch or ()) - {a for _, a in known} - {f"{a}_window" for a in windows}
    if unknown:
        parser.error(f"unknown architectures (or their library is not installed): {', '.join(sorted(unknown))}")
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for s in installed for name in libraries[s])
    versions = f"{versions}, torch {torch.__version__}"

    def write(row: str, cells: dict[str, str]) -> None:  # after each row: a run stopped early keeps its rows
        every = merged({row: cells}, versions, [a for _, a in known] + [f"{a} (logits loss)" for a in LOGITS_ROWS]
                       + [f"{a} (window 4 of 8)" for a in WINDOW_ROWS])
        stated = sorted({v for r in every.values() for v in r["versions"].split(", ")})
        text = render({r: every[r]["cells"] for r in every}, versions=", ".join(stated), dtype=args.dtype)
        CELLS.write_text(json.dumps(every, indent=1, ensure_ascii=False) + "\n")
        (ROOT / "docs" / "compatibility.md").write_text(text)

    rows = matrix([(s, a) for s, a in known if not args.arch or a in args.arch], args.dtype,
                  write if args.write else lambda row, cells: None,
                  ("library", "logits") if args.loss == "both" else (args.loss,), windows)
    print(render(rows, versions=versions, dtype=args.dtype))


if __name__ == "__main__":
    main()
