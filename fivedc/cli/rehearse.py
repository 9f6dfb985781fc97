"""`fivedc rehearse`: one rank of each class runs the plan's real step at full scale, on nothing.

`fivedc rehearse PLAN.json` or `fivedc rehearse MODEL --mesh ... [compile flags]` runs
`fivedc/runtime/rehearse.py` for every class of ranks of the plan's memory estimate and
prints, per class, the estimate against the rehearsed peak, by category, with the
largest storages live at the peak; `--report out.json` writes them. `--device meta`
(the only device this build rehearses on) allocates nothing: a rank of a 405B plan runs
on a laptop.
"""

from __future__ import annotations

import json

from fivedc.errors import FivedcError

TOLERANCE = 0.05  # the estimate is held to the rehearsed peak within this


def rehearse_args(p) -> None:
    p.add_argument("--device", choices=("meta",), default="meta",
                   help="meta (default): shapes and storages without memory, any plan on any machine")
    p.add_argument("--dtype", default=None, help="bf16 (default), fp32 or fp64, for a model compiled here")
    p.add_argument("--source", default=None, metavar="MODEL",
                   help="for a plan: the model file it was compiled from (default: the file the plan names)")
    p.add_argument("--report", default=None, metavar="OUT.json",
                   help="write per class of ranks the estimate and the rehearsed peak, by category")


def run_rehearse(args, *, defaults) -> int:
    from fivedc.cli.shared import executed_plan, progress_printer
    from fivedc.runtime.rehearse import rehearse_plan
    from fivedc.runtime.train import DTYPES, check_trainable

    plan = executed_plan(args, defaults, verb="rehearsing", dtype=args.dtype or "bf16")
    check_trainable(plan.graph)
    if plan.dtype not in DTYPES:
        raise FivedcError(f"the plan trains in {plan.dtype}; the runtime trains in {', '.join(DTYPES)}",
                          hint="compile with --dtype bf16 (or fp32)")
    print(f"rehearsing {args.model} on mesh {plan.mesh} ({plan.mesh.world} ranks, {plan.dtype})")
    print(f"one rank of each of {len(plan.memory.ranks)} classes of ranks, one step on the meta device")
    rehearsal = rehearse_plan(plan, on_progress=progress_printer())
    for line in render_rehearsal(rehearsal):
        print(line)
    if args.report is not None:
        from fivedc.files import write_output

        write_output(args.report, json.dumps(rehearsal.to_json(), indent=1) + "\n",
                     inputs=(args.model.split(":")[0],), what="report")
        print(f"wrote {args.report}")
    return 0


def render_rehearsal(rehearsal) -> list[str]:
    """Per class: each category estimated and at the rehearsed peak, the totals and their
    ratio, and the largest storages live at the peak; within 100 columns."""
    from fivedc.plan.summary import format_bytes
    from fivedc.runtime.live_bytes import CATEGORIES

    lines = []
    for c in rehearsal.classes:
        verdict = "within" if abs(c.ratio - 1) <= TOLERANCE else "OUTSIDE"
        lines += ["", f"ranks {c.ranks} (rank {c.rank}): estimate {format_bytes(c.estimated.total)}, "
                  f"rehearsed peak {format_bytes(c.peak)}: {c.ratio:.3f}x, {verdict} "
                  f"{TOLERANCE:.0%}", f"  {'':<12} {'estimated':>10} {'at the peak':>12}"]
        lines += [f"  {k:<12} {format_bytes(getattr(c.estimated, k)):>10} {format_bytes(c.at_peak[k]):>12}"
                  for k in CATEGORIES]
        lines.append("  largest live at the peak:")
        lines += [f"    {format_bytes(s.nbytes):>10}  {s.category:<11} {s.dtype:<8} "
                  f"{'x'.join(map(str, s.shape)) or 'scalar':<22} {s.made_by}"[:100].rstrip() for s in c.largest[:5]]
    return lines
