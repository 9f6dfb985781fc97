"""Published training layouts against `fivedc search`: each compiled at its published shape, then the search's best.

For each case (an example model at its published shape, the cluster it ran on, and
its published layout written as `fivedc compile` flags) this compiles the published
layout (`fivedc.pipeline.compile_graph`, agreement proof included) and runs the
layout search (`fivedc.search.search.search`, keeping the best), and prints one row:
the published layout's estimated step time, MFU and busiest rank's memory (and
whether that fits), the reported figure where the source gives one, the search's best
layout with its figures, the ratio of the two step times, and where the difference
lies: the step's parts (pipeline bubble, collectives in the layers, gradient sync and
ZeRO gathers, compute) compared between the two plans, the largest first. Every
figure comes from the compiler; the reported ones are the sources' (in the example
files' comments).

    python benchmarks/published_layouts.py            # prints the table (a few minutes on 2 cores)
    python benchmarks/published_layouts.py --write    # also replaces the table in docs/search.md
    python benchmarks/published_layouts.py --only gpt3-175b,palm-540b
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "search.md"
BEGIN, END = "<!-- published-layouts:begin -->", "<!-- published-layouts:end -->"
GiB = 2**30


@dataclass(frozen=True, slots=True)
class Case:
    key: str
    title: str  # model and the source of its layout
    model: str  # relative to the repository
    gpus: int
    gpu: str  # a profile of fivedc/ir/hardware.toml
    flags: str  # the published layout, as `fivedc compile` flags (the mesh's nearest where fivedc differs)
    seq: int | None = None  # shape overrides (`--seq`, `--global-batch`)
    global_batch: int | None = None
    reported: str = "none published"  # the source's throughput figure, as it gives it
    reported_mfu: float | None = None  # model FLOPs utilisation it gives (or follows from it), for the ratio
    reported_tokens_per_gpu: float | None = None  # or the tokens/s per GPU it gives
    ran: bool = True  # the layout was run as published (fivedc's layout is the same, not only the nearest)

    def argv(self) -> list[str]:
        shape = [f for name, value in (("--seq", self.seq), ("--global-batch", self.global_batch))
                 if value is not None for f in (name, str(value))]
        return ["compile", self.model, *shlex.split(self.flags), *shape, "--gpu", self.gpu]

    def command(self) -> str:
        return "fivedc " + " ".join(self.argv())


CASES = (
    Case("gpt3-175b", "GPT-3 175B (Megatron-LM, SC'21 section 5.1)", "examples/gpt3_175b.5d", 1024, "a100",
         "--mesh 16x8x8x1x1 --schedule interleaved --microbatches 96 --recompute full",
         reported="140 TFLOP/s/GPU counting the recomputed forward (45 % of peak)",
         reported_mfu=140 / 312 * 3 / 4),  # 6 of the 8 forward-equivalents counted are the model's
    Case("llama3-405b-8k", "Llama 3 405B, 8K (Llama 3 paper table 4)", "examples/llama3_405b.5d", 16384, "h100",
         "--mesh 128x16x8x1x1 --sp --zero 2 --schedule interleaved --microbatches 16",
         reported="~400 TFLOP/s/GPU, 41 % MFU", reported_mfu=0.41),
    Case("llama3-405b-128k", "Llama 3 405B, 128K with CP16 (table 4)", "examples/llama3_405b.5d", 16384, "h100",
         "--mesh 8x16x8x16x1 --sp --zero 2 --schedule interleaved --microbatches 16", seq=131072,
         global_batch=128, reported="~380 TFLOP/s/GPU, 38 % MFU", reported_mfu=0.38),
    Case("deepseek-v3", "DeepSeek-V3 (technical report)", "examples/deepseek_v3.5d", 2048, "h800",
         "--mesh 2x16x1x1x64 --schedule dualpipe --zero 1 --microbatches 120 --recompute full",
         reported="180K H800 GPU hours per 1T tokens", reported_tokens_per_gpu=1e12 / (180e3 * 3600)),
    Case("mixtral-8x22b", "Mixtral 8x22B (NeMo performance recipe)", "examples/mixtral_8x22b.5d", 256, "h100",
         "--mesh 1x4x4x8x2 --sp --schedule interleaved --virtual 14 --microbatches 128 --zero 1", ran=False),
    Case("palm-540b", "PaLM 540B (PaLM paper sections 4-5)", "examples/palm_540b.5d", 6144, "tpu-v4",
         "--mesh 512x1x12x1x1 --zero 3 --recompute full", reported="46.2 % MFU (57.8 % HFU)", reported_mfu=0.462),
)


@dataclass(frozen=True, slots=True)
class Figures:
    """What a row shows of one plan: its layout, step, MFU and busiest rank's memory."""

    layout: str
    step: float
    mfu: float
    tokens_per_gpu: float  # tokens/s per GPU
    memory: int
    fits: bool
    recompute: str
    parts: dict  # the step's parts in seconds (`step_parts`)


def step_parts(t) -> dict[str, float]:
    """A step's seconds by kind: idle in the pipeline, blocking collectives inside the
    layers (busiest rank), the gradient sync and ZeRO gathers after backward, the rest."""
    idle = t.bubble * t.compute_seconds
    return {"bubble": idle, "collectives in layers": t.layer_comm_seconds,
            "grad sync + ZeRO gathers": t.grad_sync_seconds + t.zero_gather_seconds,
            "compute": t.compute_seconds - idle - t.layer_comm_seconds, "optimizer": t.optimizer_seconds}


def graph_of(case: Case):
    from fivedc.cli.shared import load_graph, with_shape

    return with_shape(load_graph(str(ROOT / case.model)), batch=case.global_batch, seq=case.seq)


def published_options(case: Case):
    """The case's flags read by `fivedc compile`'s own parser and option builder."""
    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_options
    from fivedc.ir.mesh import Mesh

    args = build_parser().parse_args(case.argv())
    return compile_options(args, Mesh.parse(args.mesh, rank_order=args.rank_order), dtype=args.dtype)


def published_plan(case: Case, *, prove: bool = True):
    """The published layout compiled: with the agreement proof (what `fivedc compile`
    runs), or at the plan level only (every pass but the proof: the tests' quick way)."""
    from fivedc.pipeline import PIPELINE, compile_graph, run_passes
    from fivedc.plan.planning import Draft, assemble

    graph, options = graph_of(case), published_options(case)
    if prove:
        return compile_graph(graph, options)
    return assemble(run_passes(Draft(graph), options, PIPELINE[:-1]), options)


def figures(layout: str, memory, t, recompute: str, gpus: int) -> Figures:
    return Figures(layout, t.step_seconds, t.mfu, t.tokens_per_second / gpus, memory.total, memory.total <= t.hardware.usable_bytes, recompute,
                   step_parts(t))


def searched(case: Case):
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import search

    return search(graph_of(case), gpus=case.gpus, hardware=hardware(case.gpu), compile_best=False, keep=1)


def where(published: Figures, best: Figures) -> str:
    """The two step parts that differ most (published -> best), then what else differs."""
    a, b = published.parts, best.parts
    big = sorted(a, key=lambda k: -abs(a[k] - b[k]))
    words = [f"{k} {a[k]:.3g} -> {b[k]:.3g} s" for k in big[:2] if abs(a[k] - b[k]) >= 0.02 * published.step]
    if published.recompute != best.recompute:
        words.append(f"recompute {published.recompute} -> {best.recompute}")
    if not published.fits:
        words.append("the published layout does not fit")
    return "; ".join(words) or "the same step within 2 %"


@dataclass(frozen=True, slots=True)
class Row:
    case: Case
    published: Figures | None
    refused: str | None  # the compiler's message when it refuses the published layout
    best: Figures

    def cells(self) -> list[str]:
        c, p, b = self.case, self.published, self.best
        if p is None:
            pub = [f"`{c.flags}`", f"refused: {self.refused}", "", "", ""]
        else:
            fit = "" if p.fits else " (does not fit)"
            vs = ""
            if c.reported_mfu:
                vs = f" (estimate / reported MFU {p.mfu / c.reported_mfu:.2f})"
            elif c.reported_tokens_per_gpu:
                vs = (f": {c.reported_tokens_per_gpu:,.0f} tokens/s/GPU (estimate {p.tokens_per_gpu:,.0f}, "
                      f"/ reported {p.tokens_per_gpu / c.reported_tokens_per_gpu:.2f})")
            pub = [f"`{c.flags}`", f"{p.step:.3g} s", f"{p.mfu:.1%}", f"{p.memory / GiB:.1f} GiB{fit}",
                   f"{c.reported}{vs}"]
        ratio = f"{p.step / b.step:.2f}" if p else ""
        best = [f"`{b.layout}`", f"{b.step:.3g} s", f"{b.mfu:.1%}", f"{b.memory / GiB:.1f} GiB"]
        reason = where(p, b) if p else "only the search's layout compiles"
        return [c.title, f"{c.gpus} {c.gpu}", *pub, *best, ratio, reason]


HEADER = ["model (source)", "GPUs", "published layout", "step", "MFU", "memory", "reported", "search's best",
          "step", "MFU", "memory", "published / best", "where the step differs (published -> best)"]


def run_case(case: Case) -> Row:
    from fivedc.errors import FivedcError

    try:
        plan = published_plan(case)
        published, refused = figures(case.flags, plan.memory, plan.time, plan.recompute, case.gpus), None
    except FivedcError as error:
        published, refused = None, error.message
    result = searched(case)
    s = result.best
    best = figures(s.candidate.flags(), s.memory, s.time, s.candidate.recompute, case.gpus)
    return Row(case, published, refused, best)


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def commands(rows: list[Row]) -> str:
    out = []
    for row in rows:
        c = row.case
        shape = "".join(f" --{n} {v}" for n, v in (("seq", c.seq), ("global-batch", c.global_batch)) if v)
        out.append(f"    {c.command()}\n    fivedc search {c.model} --gpus {c.gpus} --gpu {c.gpu}{shape}")
    return "\n".join(out)


def section(rows: list[Row], command: str, seconds: float) -> str:
    return (f"{BEGIN}\nGenerated by `{command}` ({seconds:.0f} s on the machine that wrote it); the same layouts "
            f"by hand:\n\n{commands(rows)}\n\n{table(rows)}\n{END}")


def write_doc(text: str, doc: Path = DOC) -> None:
    """Replace what lies between the markers in the section "## Published layouts against the search"."""
    old = doc.read_text()
    if BEGIN not in old or END not in old:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to replace")
    head, rest = old.split(BEGIN, 1)
    doc.write_text(head + text + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/search.md")
    parser.add_argument("--only", default=None, metavar="KEYS", help="comma-separated case keys: "
                        + ", ".join(c.key for c in CASES))
    args = parser.parse_args(argv)
    keys = args.only.split(",") if args.only else [c.key for c in CASES]
    unknown = set(keys) - {c.key for c in CASES}
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(sorted(unknown))}")
    if args.write and args.only:
        raise SystemExit("--write replaces the whole table: run it without --only")
    start, rows = time.perf_counter(), []
    for case in (c for c in CASES if c.key in keys):
        case_start = time.perf_counter()
        rows.append(run_case(case))
        print(f"{case.key}: {time.perf_counter() - case_start:.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    command = "python benchmarks/published_layouts.py" + (f" --only {args.only}" if args.only else "") + " --write"
    text = section(rows, command, seconds)
    print(text)
    if args.write:
        write_doc(text)
        print(f"wrote the table into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
