"""The fx frontend's time against depth: a model of 2 and of 32 layers, traced and compiled.

Three paths, each at 2 and 32 layers (hidden 256, 8/4 heads, sequence 128, batch 8, fp32):
`examples/llama.py` (Meta's Llama written the usual way: torch.fx's symbolic trace,
the layers one `Repeat` traced once), Hugging Face's LlamaForCausalLM with its own
loss (`examples/hf_models.py`, built without weights: torch.export of two layers, the
graph unrolled to all, `fivedc/frontends/fx/layer_export.py`) and, side by side, the
same model exported whole (`hf_llama_whole`, as before). Each row is the median of `--repeats` runs of `trace_module` and of
`compile_graph` at 2x1x2x1x1 with SP (the proof that the ranks agree included), run
alternately with the 2-layer model of the same path; the ratio 32 / 2 layers says
how the time grows with depth. The issue's bar: a 32-layer model under 5 s.

    python benchmarks/fx_depth.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

import fivedc
from fivedc.frontends.fx import trace as fx_trace
from fivedc.frontends.fx_module import trace_module
from fivedc.frontends.python_file import import_file
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SIZES = dict(hidden=256, heads=8, kv_heads=4, ffn=688, vocab=2048, seq=128, batch=8)


def build(path: str, layers: int):
    """(module, example inputs) of `path` ("llama" or "hf_llama") at `layers` layers."""
    s = SIZES
    if path == "llama":
        m = import_file(EXAMPLES / "llama.py")
        args = m.ModelArgs(dim=s["hidden"], n_layers=layers, n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                           vocab_size=s["vocab"], ffn_dim=s["ffn"], max_seq_len=s["seq"])
        return m.factory(batch=s["batch"], args=args, dtype=torch.float32)
    hf = import_file(EXAMPLES / "hf_models.py")
    model, _ = hf.build("llama", dtype=torch.float32, weights=False, hidden_size=s["hidden"],
                        num_hidden_layers=layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                        intermediate_size=s["ffn"], vocab_size=s["vocab"], max_position_embeddings=s["seq"])
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
    return model, (ids, ids.clone())


def once(path: str, layers: int) -> tuple[float, float]:
    """Seconds to trace and to compile one freshly built model (`hf_llama_whole`: Hugging Face's
    exported whole, as before the layers were exported two and unrolled)."""
    module, inputs = build(path.removesuffix("_whole"), layers)
    start = time.perf_counter()
    with _exported_whole(path.endswith("_whole")):
        graph = trace_module(module, inputs).graph
    traced = time.perf_counter()
    compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), sequence_parallel=True))
    return traced - start, time.perf_counter() - traced


@contextlib.contextmanager
def _exported_whole(whole: bool):
    """The frontend without its layer-by-layer export (fivedc/frontends/fx/layer_export.py)."""
    saved = fx_trace._by_layers
    if whole:
        fx_trace._by_layers = lambda *args: None
    try:
        yield
    finally:
        fx_trace._by_layers = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default="llama,hf_llama,hf_llama_whole")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, fivedc {fivedc.__version__}, medians of {args.repeats}")
    print("| model | layers | trace (s) | compile 2x1x2x1x1 SP (s) | total (s) | total / 2 layers |")
    print("|---|---|---|---|---|---|")
    for path in args.paths.split(","):
        once(path, 2)  # warm-up: imports, first calls
        runs: dict[int, list[tuple[float, float]]] = {2: [], 32: []}
        for _ in range(args.repeats):
            for layers in (2, 32):
                runs[layers].append(once(path, layers))
        totals = {n: statistics.median(t + c for t, c in r) for n, r in runs.items()}
        for n, r in runs.items():
            trace, comp = statistics.median(t for t, _ in r), statistics.median(c for _, c in r)
            print(f"| {path} | {n} | {trace:.2f} | {comp:.2f} | {totals[n]:.2f} | {totals[n] / totals[2]:.2f} |")


if __name__ == "__main__":
    main()
