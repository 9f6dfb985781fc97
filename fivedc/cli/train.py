"""`fivedc train`: train a model on token files with a plan, and keep what it learns.

`fivedc train MODEL_OR_PLAN --data train.bin [--val val.bin]` compiles the model for
`--mesh` with the same options as `fivedc run` (or takes a saved plan as it is),
checks the token files against the model (whole ids, one batch at least, every id
inside the vocabulary) and which input gets what (`runtime/data.input_roles`),
then trains on the mesh's world of local processes, on Ray actors (`--launcher ray`) or
as one rank under torchrun (`fivedc/cli/train_launch.py`, which also restarts a job
whose rank died): `runtime/train_loop.py` on each rank. The plan, `--mesh auto`
among them, comes from `fivedc/cli/train_plan.py`; where the run starts (`--resume auto`:
the save directory's latest checkpoint) from `fivedc/cli/train_resume.py`. A
`file.py:factory` model starts from the
module's own weights (written once to a temporary safetensors file the ranks read
their shards from); a DSL model from seeded weights. Rank 0's rows become progress
lines, the `--log` JSONL file and the `--plot` picture (`fivedc/cli/train_report.py`).
Everything the run writes is checked first, before the model is compiled
(`fivedc/cli/train_outputs.py`), and the save directory is locked for the whole run
(`runtime/save_lock.py`).
"""

from __future__ import annotations

import os

from fivedc.cli.screen import say
from fivedc.cli.train_launch import LAUNCHERS
from fivedc.errors import FivedcError

def train_args(p) -> None:
    """The flags of `fivedc train` besides the mesh, plan options and local-run ones."""
    p.add_argument("--data", required=True, metavar="FILE", help="training tokens: a flat array of token ids "
                   "(uint16 as nanoGPT writes them; examples/make_data.py makes one)")
    p.add_argument("--val", default=None, metavar="FILE", help="validation tokens, the same format")
    p.add_argument("--data-dtype", default="uint16", help="the token files' id type: uint16 (default) or uint32")
    p.add_argument("--steps", type=int, default=None, help="train to this step (default 100)")
    p.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp64, for a model compiled here")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    p.add_argument("--min-lr", type=float, default=None, help="the cosine's final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warmup (default 0)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (default 1; 0: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and of a DSL model's weights")
    p.add_argument("--val-every", type=int, default=0, metavar="N",
                   help="validation loss every N steps (always at the last step and at saves)")
    p.add_argument("--val-batches", type=int, default=8, help="batches per validation (default 8)")
    p.add_argument("--save-dir", default=None, metavar="DIR", help="write checkpoints here (every rank's shards, "
                   "one index); with --resume and no --save-dir, the checkpoint's own directory")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="a checkpoint every N steps "
                   "(and at the last step)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept besides the best (default 3)")
    p.add_argument("--resume", default="auto", metavar="DIR", help="continue from a checkpoint (a save directory: "
                   "its latest), on any mesh and options; unset training flags take the checkpoint's values "
                   "(default auto: --save-dir's latest checkpoint if it holds one, else afresh)")
    p.add_argument("--until", type=int, default=None, metavar="STEP", help="stop after this step (and save there), "
                   "the schedule still running to --steps")
    p.add_argument("--log", default=None, metavar="FILE", help="append one JSON object per step to FILE")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw the loss curve to FILE (.png, .svg, .pdf)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="local", help="local: the mesh's world of processes "
                   "here (default); ray: one Ray actor per rank (pip install 'fivedc[ray]'); under torchrun each "
                   "process is one rank")
    p.add_argument("--address", default=None, metavar="ADDR", help="--launcher ray: the cluster to join "
                   "(default: start a local Ray instance)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N", help="after a rank dies, start again from "
                   "the latest checkpoint, at most N times (local and ray; under torchrun, torchrun's flag)")
    p.add_argument("--gpu", default=None, metavar="NAME", help="the GPU profile --mesh auto searches for "
                   "(default h100; the names fivedc search --gpu takes)")
    p.add_argument("--hardware", action="append", default=[], metavar="FILE", help="a TOML file of GPU profiles")


def run_train(args, *, defaults) -> int:
    """`defaults`: the train command's arguments as parsed with no flags (which flags were given)."""
    from fivedc.cli.shared import check_local_run
    from fivedc.cli.train_launch import check_launch
    from fivedc.cli.train_outputs import check_train_outputs
    from fivedc.cli.train_plan import train_plan
    from fivedc.cli.train_resume import resolve_saves, resume_folder
    from fivedc.runtime.data import input_roles
    from fivedc.runtime.train import DTYPES, check_trainable

    launched = "WORLD_SIZE" in os.environ
    talk = not launched or os.environ.get("RANK") == "0"
    check_local_run(args)
    check_launch(args, launched=launched)
    resume = resume_folder(args)
    outputs = check_train_outputs(args, resume=resume)  # every file the run writes, before any work
    plan, module, mesh_note = train_plan(args, defaults, launched=launched)
    check_trainable(plan.graph)
    if plan.dtype not in DTYPES:
        raise FivedcError(f"the plan trains in {plan.dtype}; train runs {', '.join(DTYPES)}",
                          hint="compile with --dtype fp32 (or bf16)")
    saves = resolve_saves(args, defaults, plan, resume=resume)
    if saves.done:
        if talk:
            say(saves.notes[0])
        return 0
    roles = input_roles(plan.graph)
    job = _job(args, plan, module, saves)
    with _holding(saves.save_dir if talk else None):  # the save directory is this run's to the end
        if talk:
            _header(args, job, roles, saves, mesh_note)
        progress = _train(job, saves, args, launched=launched, log_target=outputs.log if talk else None)
        if talk:
            _finish(progress, args, plan, saves)
    return 0


def _holding(save_dir: str | None):
    """The save directory's lock for the run (`runtime/save_lock.py`)."""
    import contextlib

    from fivedc.runtime.save_lock import hold_save_dir

    return hold_save_dir(save_dir) if save_dir is not None else contextlib.nullcontext()


def _train(job, saves, args, *, launched: bool, log_target):
    """Run the job; rows go to the progress printer and the log (opened at the first row)."""
    from fivedc.cli.train_launch import launch
    from fivedc.log_file import LogFile

    log = LogFile(log_target, args.log) if log_target is not None else None
    try:
        progress = _progress(job, saves.start, log)
        launch(job, progress, args, launched=launched)
    finally:
        if log is not None:
            log.close()
    return progress


def _job(args, plan, module, saves):
    """What every rank runs: the plan, the checked token files, where to start and save;
    for a traced module its weights (unless resumed) and names."""
    from fivedc.runtime.export import names_of
    from fivedc.runtime.data import TokenFile, check_token_file
    from fivedc.runtime.fault_hook import faults_from_env
    from fivedc.runtime.train_loop import TrainJob

    tokens = check_token_file(args.data, args.data_dtype, graph=plan.graph, what="training")
    val_tokens = check_token_file(args.val, args.data_dtype, graph=plan.graph, what="validation") if args.val else 0
    init = names = states = hooks = None
    if module is not None:
        module, traced = module
        names = names_of(traced, module)
        init = None if saves.resume else traced.to_ir_params(module.state_dict())
        states = None if saves.resume else traced.state_values(module)  # its buffers the forward uses
        hooks = args.model if getattr(module, "fivedc_after_step", None) is not None else None
    return TrainJob(plan=plan, config=saves.config, train=TokenFile(args.data, args.data_dtype), train_tokens=tokens,
                    val=TokenFile(args.val, args.data_dtype) if args.val else None, val_tokens=val_tokens, init=init,
                    resume=saves.resume, save_dir=saves.save_dir, names=names, until=args.until,
                    faults=faults_from_env(), states=states, hooks=hooks)


def _header(args, job, roles, saves, mesh_note: str | None) -> None:
    from fivedc.runtime.data import token_shape

    plan, config, tokens = job.plan, job.config, job.train_tokens
    batch, seq = token_shape(plan.graph)
    for line in (mesh_note,) * bool(mesh_note) + saves.notes:
        say(line)
    say(f"training {args.model} on mesh {plan.mesh} ({plan.mesh.world} processes, {plan.dtype}) from step "
        f"{saves.start} to {job.stop}{f' (of {config.steps})' if job.stop < config.steps else ''}: batches of "
        f"{batch} x {seq} tokens from {args.data} ({tokens} tokens, {(tokens - 1) // seq // batch} steps per epoch); "
        f"{_roles_text(roles)}")


def _progress(job, start: int, log):
    from fivedc.cli.train_report import Progress

    return Progress(steps=job.stop, first=start, log=log)


def _finish(progress, args, plan, saves) -> None:
    from fivedc.cli.train_report import draw_losses

    say(progress.summary())
    if saves.save_dir is not None:
        say(f"checkpoints in {saves.save_dir} (the same command with a larger --steps continues the run)")
    if args.plot:
        draw_losses(progress.rows, args.plot, title=f"{args.model} on {plan.mesh}")
        print(f"wrote {args.plot}")


def _roles_text(roles: dict[str, str]) -> str:
    what = {"inputs": "the tokens", "targets": "the next tokens", "labels": "the tokens (the model shifts them)"}
    return ", ".join(f"{name} <- {what[role]}" for name, role in roles.items())
