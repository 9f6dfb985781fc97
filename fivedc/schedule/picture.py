"""Draw a simulated schedule: one row per pp rank, time across, a box per computation.

F, B, I and W boxes have their own colours, labelled with the microbatch (and
`.chunk` when a rank holds several chunks); transfers with a cost are thin grey
boxes; idle time is the grey row background left showing. The title carries the
bubble fraction. matplotlib is imported here only, through its object API with the
Agg canvas, so nothing changes matplotlib's global backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fivedc.schedule.actions import COMPUTE, ActionKind as K, Schedule, ScheduleError
from fivedc.schedule.simulator import SimResult, simulate

COLOURS = {K.FORWARD: "#4c78a8", K.BACKWARD: "#54a24b", K.BACKWARD_INPUT: "#f58518", K.BACKWARD_WEIGHT: "#b279a2"}
NAMES = {K.FORWARD: "F forward", K.BACKWARD: "B backward", K.BACKWARD_INPUT: "I input grad",
         K.BACKWARD_WEIGHT: "W weight grad"}
IDLE = "#e4e4e4"
MAX_LABELS = 3000  # beyond this many boxes, labels would only be noise


def draw_schedule(schedule: Schedule, path: str | Path, costs: Mapping[str, float] | None = None) -> SimResult:
    """Simulate `schedule` with `costs` and draw it to `path` (.png or .svg); returns the simulation."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ScheduleError(f"cannot draw a schedule to {path.name!r}", hint="name a .png or .svg file")
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ScheduleError("drawing a schedule needs matplotlib", hint="pip install 'matplotlib>=3.8'") from e
    result = simulate(schedule, costs)
    p, span = schedule.p, result.makespan or 1.0
    width = min(4 + span * 0.25, 40)
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # keep text as text in SVG
        fig = Figure(figsize=(width, 1.2 + 0.45 * p))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        _draw_rows(ax, result, label=sum(len(a) for a in schedule.ranks) <= MAX_LABELS, width=width)
        kinds = [k for k in COLOURS if any(a.kind is k for acts in schedule.ranks for a in acts)]
        handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds] + [Patch(color=IDLE, label="idle")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        ax.set_xlim(0, span)
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_xlabel("time")
        ax.set_title(title(schedule, result))
        fig.tight_layout()
        fig.savefig(path)
    return result


def title(schedule: Schedule, result: SimResult) -> str:
    s = schedule
    return (f"{s.name}: p={s.p} m={s.m} v={s.v}  bubble {result.bubble_fraction:.1%}  "
            f"peak live activations {max(result.peak_live)}")


def _draw_rows(ax, result: SimResult, *, label: bool, width: float) -> None:  # noqa: ANN001 (matplotlib Axes)
    s = result.schedule
    per_unit = width * 72 / (result.makespan or 1.0)  # points per time unit, roughly
    for r, acts in enumerate(s.ranks):
        ax.broken_barh([(0, result.makespan)], (r - 0.4, 0.8), facecolors=IDLE)
        boxes: dict[K, list[tuple[float, float]]] = {}
        for a, t0, t1 in zip(acts, result.start[r], result.end[r]):
            if t1 <= t0:
                continue
            boxes.setdefault(a.kind, []).append((t0, t1 - t0))
            if label and a.kind in COMPUTE:
                text = f"{a.microbatch}.{a.chunk}" if s.v > 1 else str(a.microbatch)
                size = min(8.0, (t1 - t0) * per_unit / max(len(text), 1) * 1.6)
                if size >= 3:
                    ax.text((t0 + t1) / 2, r, text, ha="center", va="center", fontsize=size, color="white")
        for kind, spans in boxes.items():
            colour, height = (COLOURS[kind], 0.8) if kind in COLOURS else ("#888888", 0.3)
            ax.broken_barh(spans, (r - height / 2, height), facecolors=colour, edgecolors="white", linewidth=0.5)
