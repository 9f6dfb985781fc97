"""What `fivedc train` writes, checked by the one output rule before any work starts.

The outputs are `--log` (appended to: `fivedc/log_file.py`), `--plot` and the save
directory (`--save-dir`, or with `--resume PATH` and none the checkpoint's own directory).
The inputs they must not be are the model's file (or the plan), the token files and
every file of the checkpoint resumed from; no output may lie inside the checkpoint
read, inside one of the save directory's checkpoints (a save prunes them), or take a
name the save directory uses for itself (`best_model.safetensors`, the lock,
`step-N`, `.tmp-step-N`). The save directory's `best_model.safetensors`, replaced on a
new best validation loss, is checked by the same rule at the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fivedc.files import OutputError
from fivedc.outputs import Output, check_outputs

BEST = "best_model.safetensors"


@dataclass(frozen=True, slots=True)
class TrainOutputs:
    log: Path | None  # the file --log appends to (a symlink inside the tree followed)
    save_dir: str | None


def check_train_outputs(args, *, resume: Path | None) -> TrainOutputs:
    """`resume`: the checkpoint folder the run continues from (`train_resume.resume_folder`)."""
    from fivedc.cli.train_report import check_plot
    from fivedc.runtime.checkpoint import committed

    check_plot(args.plot)
    save_dir = args.save_dir if args.save_dir is not None else (str(resume.parent) if resume else None)
    read = ((resume,) if resume is not None else ()) + tuple(p for _, p in (committed(save_dir) if save_dir else []))
    outputs = [Output("--log", args.log, "log") if args.log is not None else None,
               Output("--plot", args.plot, "picture") if args.plot is not None else None,
               Output("--save-dir", save_dir, "save directory") if save_dir is not None else None]
    targets = check_outputs(outputs, inputs=_inputs(args, resume), read_dirs=read)
    if save_dir is not None and Path(save_dir).is_dir():  # the best model: no directory, FIFO or link out there
        check_outputs([Output(f"--save-dir {save_dir}:", str(Path(save_dir) / BEST), "model")])
    if save_dir is not None:
        for out in outputs[:2]:
            if out is not None:
                _not_reserved(out, targets[out.flag], Path(save_dir).resolve())
    return TrainOutputs(targets.get("--log"), save_dir)


def _inputs(args, resume: Path | None) -> tuple[str, ...]:
    from fivedc.frontends.python_file import parse_spec

    files = [str(parse_spec(args.model)[0]), args.data] + ([args.val] if args.val else [])
    if resume is not None:
        files += [str(p) for p in resume.iterdir()]
    return tuple(files)


def _not_reserved(out: Output, target: Path, save_dir: Path) -> None:
    from fivedc.runtime.checkpoint import STEP_DIR
    from fivedc.runtime.save_lock import LOCK

    if target.parent != save_dir:
        return
    name = target.name
    if name in (BEST, LOCK) or STEP_DIR.fullmatch(name) or name.startswith((".tmp-step-", ".old-step-")):
        raise OutputError(f"{out.flag} {out.path} is {name} of the save directory {save_dir}, which the run "
                          f"writes itself", hint=f"give {out.flag} another name")


__all__ = ["BEST", "TrainOutputs", "check_train_outputs"]
