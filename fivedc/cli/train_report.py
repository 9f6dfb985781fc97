"""What `fivedc train` shows and keeps of a run: progress lines, the JSONL log, the loss picture.

Rank 0 of the run hands over one row per step (`runtime/train_loop.py`:
`{"step", "loss", "lr", "grad_norm", "tokens", "seconds"}`, `"val_loss"` where
measured). `Progress` prints a line with a bar, the loss, tokens per second and the
time left (from the last ten steps), at most about 50 lines a run plus every
validation, and appends each row to the `--log` file as one JSON object (written at
once: a run that dies leaves every step it finished; `fivedc/log_file.py`). `draw_losses` draws the
training and validation loss against the step with matplotlib (Agg canvas, the
global backend untouched).
"""

from __future__ import annotations

import json
from pathlib import Path

from fivedc.cli.screen import MAX_COLUMNS
from fivedc.errors import FivedcError
from fivedc.log_file import LogFile

BAR = 10
RECENT = 10


class Progress:
    """Prints and logs the rows of a run of `steps` steps (from `first`, when resumed)."""

    def __init__(self, *, steps: int, first: int = 0, log: LogFile | None = None, print_fn=print) -> None:
        self.steps, self.first, self.log, self.print = steps, first, log, print_fn
        self.every = max(1, (steps - first) // 50)
        self.rows: list[dict] = []

    def line(self, text: str) -> None:
        """A progress line that is not a row (JSON rows start with '{')."""
        if text.startswith("{"):
            self.row(json.loads(text))
        else:
            self.print(f"  {text}", flush=True)

    def row(self, row: dict) -> None:
        self.rows.append(row)
        if self.log is not None:
            self.log.write(row)
        step = row["step"]
        if "val_loss" in row or step % self.every == 0 or step in (self.first + 1, self.steps):
            self.print(self.format(row), flush=True)

    def format(self, row: dict) -> str:
        step, steps = row["step"], self.steps
        filled = BAR * step // steps
        recent = self.rows[-RECENT:]
        seconds = sum(r["seconds"] for r in recent) or 1e-9
        tokens = _tokens_of(row) * len(recent)
        val = f"  val {row['val_loss']:.4f}" if "val_loss" in row else ""
        figures = (f"loss {row['loss']:.4f}{val}  lr {row['lr']:.2e}  |g| {row['grad_norm']:.3g}  "
                   f"{_si(tokens / seconds)} tok/s  ETA {_clock(seconds / len(recent) * (steps - step))}")
        line = f"step {step:>{len(str(steps))}}/{steps} [{'#' * filled}{'-' * (BAR - filled)}] {figures}"
        return line if len(line) <= MAX_COLUMNS else f"step {step}/{steps} {figures}"  # the bar goes first

    def summary(self) -> str:
        if not self.rows:
            return "no step was run"
        last = self.rows[-1]
        seconds = sum(r["seconds"] for r in self.rows)
        vals = [r["val_loss"] for r in self.rows if "val_loss" in r]
        val = f", validation loss {vals[-1]:.4f} (best {min(vals):.4f})" if vals else ""
        tokens = sum(_tokens_of(r) for r in self.rows)
        return (f"trained {len(self.rows)} steps to step {last['step']}: loss {last['loss']:.4f}{val}; "
                f"{_si(tokens / max(seconds, 1e-9))} tokens/s over the steps")


def _tokens_of(row: dict) -> int:
    return row["tokens"] // row["step"]  # every step reads one global batch


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def check_plot(path: str | None) -> None:
    """The picture's format (the file itself is checked with the other outputs: train_outputs.py)."""
    if path is not None and Path(path).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise FivedcError(f"--plot {path}: the picture is .png, .svg or .pdf", hint="e.g. --plot loss.png")


def draw_losses(rows: list[dict], path: str, *, title: str) -> None:
    """The training loss (and validation loss) against the step, written atomically to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fivedc.files import write_output

    def draw(tmp: Path) -> None:
        fig = Figure(figsize=(7, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training loss", linewidth=1)
        vals = [r for r in rows if "val_loss" in r]
        if vals:
            ax.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(tmp)

    write_output(path, draw, what="picture")
