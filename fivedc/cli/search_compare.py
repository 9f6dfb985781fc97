"""`fivedc search ... --compare MESH [layout flags]`: the user's layout beside the search's best.

The compared layout is compiled as `fivedc compile MODEL --mesh MESH [flags] --gpu GPU` would
compile it (same model, batch, sequence, GPU and `--fp8` as the search), so its step and memory
are that command's; the search then scores every layout faster than it (`search(floor=...)`),
so its rank among the layouts that fit is exact. With `--explain`, both steps term by term
(`fivedc/estimates/breakdown.py`): the seconds of each, the difference, and a flag on
every term whose advantage alone exceeds the model's error on published runs
(`model_error.STEP_TIME`), where the best's lead rests on that one term.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.cli.screen import say
from fivedc.errors import FivedcError

# The flags that shape a layout the search varies (`fivedc/search/space.py`), for --compare.
LAYOUT_FLAGS = ("rank_order", "sp", "cp_attention", "schedule", "microbatches", "virtual", "zero", "recompute")


def compare_args(p) -> None:
    from fivedc.passes.base import CP_VARIANTS
    from fivedc.passes.recompute import RECOMPUTE_MODES
    from fivedc.schedule import DEFAULT_SCHEDULE

    p.add_argument("--compare", default=None, metavar="MESH",
                   help="compile this layout (DPxPPxTPxCPxEP and the flags below, as fivedc compile takes them) "
                   "and show its rank, step and memory beside the best; with --explain, both steps term by term")
    p.add_argument("--rank-order", default=None, help="--compare: innermost axis first (default tp,cp,ep,dp,pp)")
    sp = p.add_mutually_exclusive_group()
    sp.add_argument("--sp", dest="sp", action="store_true", default=None, help="--compare: sequence parallelism on")
    sp.add_argument("--no-sp", dest="sp", action="store_false", help="--compare: sequence parallelism off")
    p.add_argument("--cp-attention", choices=CP_VARIANTS, default=None, help="--compare: attention across cp")
    p.add_argument("--schedule", default=None,
                   help=f"--compare: pipeline schedule for pp > 1 (default {DEFAULT_SCHEDULE})")
    p.add_argument("--microbatches", type=int, default=None, help="--compare: microbatches per step")
    p.add_argument("--virtual", type=int, default=None, help="--compare: chunks per pp rank for interleaved")
    p.add_argument("--zero", type=int, default=None, metavar="STAGE", help="--compare: ZeRO stage (default 0)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="--compare: recomputation (default: the model's @recompute, else none)")


@dataclass(frozen=True)
class Compared:
    """The user's layout, compiled."""

    flags: str  # the fivedc compile flags that give it
    plan: object  # ExecutionPlan, with its time on the search's hardware

    @property
    def step(self) -> float:
        return self.plan.time.step_seconds


def compared_layout(args, graph, hw, *, gpus: int, dtype: str) -> Compared | None:
    """The layout --compare names, compiled (None without --compare); bad input is a FivedcError."""
    given = [f"--{k.replace('_', '-')}" for k in LAYOUT_FLAGS if getattr(args, k) is not None]
    if args.compare is None:
        if given:
            raise FivedcError(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} the layout --compare names; "
                              "without --compare the search chooses every option itself",
                              hint="add --compare MESH (e.g. --compare 8x1x8x1x1), or drop the flag")
        return None
    from fivedc.ir.mesh import Mesh, MeshAxis
    from fivedc.passes.base import CompileOptions
    from fivedc.schedule import DEFAULT_SCHEDULE
    from fivedc.pipeline import compile_graph

    try:
        mesh = Mesh.parse(args.compare, rank_order=args.rank_order)
    except FivedcError as error:
        raise FivedcError(f"--compare {args.compare}: {error.message}", hint=error.hint) from None
    if mesh.world != gpus:
        raise FivedcError(f"--compare {args.compare} has {mesh.world} ranks, and the search --gpus {gpus}: "
                          "the layouts must use the same GPUs",
                          hint=f"give a mesh whose product is {gpus} (dp x pp x tp x cp x ep), or change --gpus")
    try:
        options = CompileOptions(mesh=mesh, sequence_parallel=args.sp, dtype=dtype, cp_attention=args.cp_attention,
                                 zero=args.zero or 0, schedule=args.schedule or DEFAULT_SCHEDULE,
                                 microbatches=args.microbatches,
                                 virtual=args.virtual, recompute=args.recompute, hardware=hw,
                                 fp8=getattr(args, "fp8", False))
        piped = [f"--{k}" for k in ("schedule", "microbatches", "virtual") if getattr(args, k) is not None]
        if mesh.size(MeshAxis.PP) == 1 and piped:
            raise FivedcError(f"{', '.join(piped)} set up a pipeline, and mesh {mesh} has pp=1: there is none",
                              hint="drop them, or give the mesh a pipeline axis, e.g. pp=2")
        plan = compile_graph(graph, options)
    except FivedcError as error:
        raise FivedcError(f"--compare {args.compare}: {error.message}", hint=error.hint) from None
    flags = [f"--mesh {mesh}"]
    for key, flag in zip((k for k in LAYOUT_FLAGS if getattr(args, k) is not None), given):
        flags.append(("--sp" if args.sp else "--no-sp") if key == "sp" else f"{flag} {getattr(args, key)}")
    return Compared(" ".join(flags + (["--fp8"] if options.fp8 else [])), plan)


def print_compared(result, compared: Compared, hw) -> None:
    """The compared layout's rank, step and memory beside the best's."""
    from fivedc.estimates.model_error import STEP_TIME
    from fivedc.plan.summary import format_bytes

    best, step, memory = result.best.time.step_seconds, compared.step, compared.plan.memory.total
    fits = memory <= hw.usable_bytes
    faster = sum(s.time.step_seconds < step for s in result.ranked)
    where = (f"would rank #{faster + 1} of the layouts that fit" if fits else
             f"does not fit ({format_bytes(memory)} of {format_bytes(hw.usable_bytes)} usable)")
    tie = ("a tie with the best by the model's error" if step <= best * (1 + STEP_TIME.spread) else
           f"slower than the best by more than the model's ±{STEP_TIME.spread:.0%}")
    if step < best:
        tie += " (faster than the search's best: a layout outside its space, docs/search.md)"
    say(f"compared: {compared.flags}: {step:.3g} s a step ({step / best:.2f}x the best's {best:.3g} s), "
        f"{format_bytes(memory)}; {where}; {tie}")


def print_explained(result, compared: Compared, console) -> None:
    """Both steps term by term, the difference, and the terms the best's lead rests on."""
    from rich.table import Table

    from fivedc.estimates.breakdown import plan_breakdown, term_order
    from fivedc.estimates.model_error import STEP_TIME

    mine, theirs = plan_breakdown(result.plan), plan_breakdown(compared.plan)
    band = STEP_TIME.spread * mine.step_seconds  # the model's error, in seconds of the best's step
    lead = theirs.step_seconds - mine.step_seconds
    scale, unit = _unit(mine.step_seconds)
    a, b = dict(mine.terms), dict(theirs.terms)
    table = Table(title=f"the step term by term ({unit}): the best, the compared layout", title_justify="left")
    for name in ("term", "best", "compared", "difference", "flag"):
        table.add_column(name, justify="left" if name in ("term", "flag") else "right")
    flagged = []
    for term in sorted(set(a) | set(b), key=term_order):
        diff = b.get(term, 0.0) - a.get(term, 0.0)
        alone = lead > band and diff > band
        flagged += [(term, diff)] if alone else []
        table.add_row(term, _figure(a.get(term), scale), _figure(b.get(term), scale), _figure(diff, scale, sign=True),
                      "> model error" if alone else "")
    table.add_row("step", _figure(mine.step_seconds, scale), _figure(theirs.step_seconds, scale),
                  _figure(lead, scale, sign=True), "")
    console.print(table)
    ranks = "/".join("-" if r is None else str(r) for r in (mine.pp_rank, theirs.pp_rank))
    say(f"difference: compared - best; the model's error (±{STEP_TIME.spread:.0%} of the best's step): "
        f"{band * scale:.3g} {unit}; with a pipeline the compute terms are the busiest pp rank's "
        f"(best/compared: {ranks})")
    if lead < 0:
        verdict = "a tie by the model's error" if -lead <= band else "faster by more than the model's error"
        say(f"the compared layout is {-lead * scale:.3g} {unit} faster than the search's best, a layout outside "
            f"the search's space (docs/search.md): {verdict}")
    elif lead == 0 and a == b:
        say("the compared layout's step is the best's, term by term: the two are a tie")
    elif lead <= band:
        say(f"the best leads by {lead * scale:.3g} {unit}, within the model's error: the two are a tie")
    elif not flagged:
        say(f"no one term carries the best's {lead * scale:.3g} {unit} lead past the model's error: it comes from "
            "several terms together")
    for term, diff in flagged:
        rest = ("without it the two would be a tie: the lead rests on this one term, and is as optimistic as "
                "the model is there" if lead - diff <= band else "the lead would hold without it")
        say(f"{term}: {diff * scale:.3g} of the best's {lead * scale:.3g} {unit} lead, more than the model's "
            f"error alone; {rest}")


def _unit(seconds: float) -> tuple[float, str]:
    """The unit to print a step of `seconds` and its parts in: s, ms or µs."""
    return next(((scale, unit) for scale, unit in ((1.0, "s"), (1e3, "ms")) if seconds * scale >= 1), (1e6, "µs"))


def _figure(value: float | None, scale: float, *, sign: bool = False) -> str:
    if value is None:
        return "-"
    x = value * scale
    return f"{x:{'+' if sign else ''},.0f}" if abs(x) >= 100 else f"{x:{'+' if sign else ''}.3g}"
