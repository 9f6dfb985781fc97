"""Where `fivedc train` starts and saves: the settings, the checkpoint resumed, the save directory.

`--resume auto` (the default) continues from the latest committed checkpoint of
`--save-dir` when it holds one, and starts afresh otherwise, so that a job a launcher
restarts (torchrun's `--max-restarts`, `--launcher ray`) picks up where it was without
a new flag; only committed checkpoints count (`step-N/` with its index: a save cut
short leaves a `.tmp-step-N/` that nothing reads). A run whose latest checkpoint is
already at its last step has nothing to do and says so (exit 0). `--resume D` (a save
directory: its latest committed checkpoint; or one `step-N` folder) continues from D.

Fresh, the training settings are the command line's. Resumed, they are the
checkpoint's, except those the command line gives (each one that differs is named:
the run then does not continue the saved schedule exactly); the checkpoint must hold
the plan's parameters at their shapes (any mesh and options), be short of `--steps`
(an explicit `--resume`), and without `--save-dir` the run saves where the checkpoint
is. A save directory that holds another run's checkpoints is refused: one directory,
one run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fivedc.errors import FivedcError
from fivedc.runtime.checkpoint_dirs import step_dir
from fivedc.runtime.train_config import TrainConfig

FLAGS = ("steps", "lr", "min_lr", "warmup", "weight_decay", "clip", "seed", "val_every", "val_batches",
         "save_every", "keep")  # TrainConfig's fields, as flags of `fivedc train`
DEFAULT_STEPS = 100


AUTO = "auto"  # --resume's default: the save directory's latest checkpoint, if any


@dataclass(frozen=True)
class Saves:
    config: TrainConfig
    start: int = 0  # steps done before
    resume: str | None = None  # the checkpoint folder resumed from
    save_dir: str | None = None
    notes: tuple[str, ...] = field(default=())  # lines to print before training
    done: bool = False  # --resume auto found the run finished: nothing to train


def resume_folder(args) -> Path | None:
    """The checkpoint the run continues from: `--resume PATH`'s, or for `--resume auto`
    the latest committed one of `--save-dir` (None: a fresh start)."""
    from fivedc.runtime.checkpoint import committed, find_checkpoint

    if args.resume != AUTO:
        return find_checkpoint(args.resume)
    found = committed(args.save_dir) if args.save_dir is not None else []
    return found[-1][1] if found else None


def resolve_saves(args, defaults, plan, *, resume: Path | None) -> Saves:
    """`resume`: `resume_folder(args)`, found before the outputs were checked."""
    from fivedc.runtime.checkpoint import committed, read_index

    if args.until is not None and args.until < 1:
        raise FivedcError(f"--until {args.until} must be a step >= 1", hint="e.g. --until 100")
    if args.save_every and args.save_dir is None and resume is None:
        raise FivedcError(f"--save-every {args.save_every} needs a place to save", hint="add --save-dir DIR")
    if resume is None:
        config = _config(args, defaults, None)
        if args.save_dir is not None:
            _check_save_dir(args.save_dir, committed(args.save_dir))
        return Saves(config, save_dir=args.save_dir)
    folder = resume
    index = read_index(folder)  # every field checked
    from fivedc.runtime.checkpoint_files import check_files
    from fivedc.runtime.resume import check_same_model

    digests = check_files(folder, index)  # inside the folder, whole, the bytes saved

    check_same_model(index, plan, where=str(folder))
    config = _config(args, defaults, index.get("config"))
    start = index["step"]
    finished = _finished(args, folder, start, config.steps)
    if finished:
        return Saves(config, start, str(folder), str(folder.parent), (finished,), done=True)
    save_dir = args.save_dir if args.save_dir is not None else str(folder.parent)
    if Path(save_dir).resolve() != folder.parent.resolve():
        _check_save_dir(save_dir, committed(save_dir))
    notes = [_resume_line(folder, index, plan, auto=args.resume == AUTO)] + _changes(args, defaults, index)
    if not digests:
        notes.append("note: the checkpoint records no digests (saved before fivedc kept them): its shards' "
                     "bytes are not checked")
    if step_dir(save_dir, start).resolve() != folder.resolve() and committed(save_dir):
        notes.append(f"note: saving into {save_dir}")
    return Saves(config, start, str(folder), save_dir, tuple(notes))


def _finished(args, folder: Path, start: int, steps: int) -> str:
    """With `--resume auto`, the line saying a run already at its end is done ("" when it
    is not); with an explicit `--resume`, an error."""
    stop = steps if args.until is None else min(args.until, steps)
    if start < stop:
        return ""
    if args.resume == AUTO:
        return (f"{folder} is at step {start}: this run is done (it trains to step {stop}); nothing to train "
                f"(a larger --steps continues it)")
    if start >= steps:
        raise FivedcError(f"the checkpoint {folder} is at step {start}, and the run goes to step {steps}: "
                          "nothing is left to train", hint=f"give --steps above {start}")
    raise FivedcError(f"--until {args.until} is not after the checkpoint's step {start}")


def _config(args, defaults, saved: dict | None) -> TrainConfig:
    values = {}
    for name in FLAGS:
        given = getattr(args, name) != getattr(defaults, name)
        values[name] = getattr(args, name) if given or saved is None else saved[name]
    if values["steps"] is None:
        values["steps"] = DEFAULT_STEPS
    return TrainConfig(**values)


def _changes(args, defaults, index: dict) -> list[str]:
    """A note per training flag given that differs from the checkpoint's setting."""
    saved = index.get("config") or {}
    notes = []
    for name in FLAGS:
        value = getattr(args, name)
        if value != getattr(defaults, name) and name in saved and value != saved[name]:
            flag = "--" + name.replace("_", "-")
            notes.append(f"note: {flag} {value} where the checkpoint had {saved[name]}"
                         + ("" if name in ("save_every", "keep", "val_every", "val_batches", "steps") else
                            ": the run does not continue the saved schedule exactly"))
    data = index.get("data", {})
    if args.data != data.get("train") and data:
        notes.append(f"note: the training file is {args.data}; the checkpoint's was {data.get('train')}")
    return notes


def _resume_line(folder: Path, index: dict, plan, *, auto: bool) -> str:
    from fivedc.runtime.checkpoint import plan_hash

    saved = index["plan"]
    same = saved["hash"] == plan_hash(plan)
    how = "the same layout" if same else (
        f"saved on mesh {saved['mesh']} (ZeRO {saved['zero']}, {saved['dtype']}), now mesh {plan.mesh} (ZeRO "
        f"{plan.zero}, {plan.dtype}): every rank reads its shards from the saved ones")
    found = " (--resume auto: the latest committed checkpoint of the save directory)" if auto else ""
    return f"resuming from {folder} at step {index['step']}{found}: {how}"


def _check_save_dir(save_dir: str, found: list) -> None:
    """A save directory that holds no other run's checkpoints (created, and locked, when
    the run starts: `runtime/save_lock.py`)."""
    path = Path(save_dir)
    if path.exists() and not path.is_dir():
        raise FivedcError(f"--save-dir {save_dir} is not a directory", hint="give a directory (it is created)")
    if found:
        raise FivedcError(f"--save-dir {save_dir} already holds checkpoints (the latest at step {found[-1][0]})",
                          hint=f"continue that run with --resume {save_dir}, or give another --save-dir")
