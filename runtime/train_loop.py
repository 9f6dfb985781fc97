"""One rank of `fivedc train`: token batches, the schedule, clipping, validation, checkpoints.

Every rank builds its part of the plan's program and its shards of the starting
parameters (seeded for a DSL model; a traced module's own weights, read from the
file the command wrote, for `file.py:factory`; a checkpoint's, read in whatever
layout saved them, when resumed: `runtime/resume.py`), then trains steps
`start..stop`: this rank's rows of the step's batch (`runtime/data.py`), forward
and backward with everything the plan decides (`runtime/train.Trainer`: ZeRO,
buckets, overlap, the pipeline schedule), the gradients clipped by their global
norm (`runtime/grad_norm.py`), AdamW at the step's learning rate
(`TrainConfig.lr_at`). The validation loss is measured on the first batches of the
validation file, in file order. Every `save_every` steps and at the last step all
ranks write a checkpoint (`runtime/checkpoint.py`); rank 0 then prunes old ones and
writes `best_model.safetensors` on a new best validation loss. After each step rank
0 hands a row (`{"step", "loss", "lr", "grad_norm", "tokens", "seconds"}`, and
`"val_loss"`, `"checkpoint"` where they happened) to `on_row`: the parent prints
and logs it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fivedc.errors import NonFiniteError
from fivedc.ir.mesh import MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.fault_hook import strike
from fivedc.runtime.data import RankBatches, Sampler, TokenFile, token_shape
from fivedc.runtime.grad_norm import clip_grad_norm, counted_params
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program, init_params, qualified_params, shard
from fivedc.runtime.resume import check_same_model, local_params, restore_state
from fivedc.runtime.train import Trainer, TrainSettings, loss_axes_of, synchronize
from fivedc.passes.chunk_params import chunk_param_names
from fivedc.passes.tied import holder_sets, shared_instances
from fivedc.runtime.train_config import TrainConfig
from fivedc.ir.states import written_keys
from fivedc.runtime.states import after_step, set_states, state_store


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs (the payload of the worker pool; plain data that pickles)."""

    plan: ExecutionPlan
    config: TrainConfig
    train: TokenFile
    train_tokens: int
    val: TokenFile | None = None
    val_tokens: int = 0
    # the full starting parameters by IR name (a traced module's): a safetensors file, or the
    # tensors themselves under a launcher (every rank traced the module; rank 0's are broadcast)
    init: str | dict | None = None
    resume: str | None = None  # a committed checkpoint folder (step-N) to continue from
    save_dir: str | None = None  # where checkpoints go (with config.save_every)
    names: dict | None = None  # the model's own parameter names (`fivedc/export.names_of`), for exports
    until: int | None = None  # stop after this step (saving there), though the schedule runs to config.steps
    attempt: int = 0  # 0 the first run of the job; k its k-th restart (torchrun's, Ray's or the local launcher's)
    faults: tuple = ()  # test-only deaths (`runtime/fault_hook.py`: FIVEDC_FAULT)
    states: dict | None = None  # a traced module's buffers the plan reads or adds to, by key (fivedc/ir/states.py)
    hooks: str | None = None  # the `file.py:factory` whose module's `fivedc_after_step` runs after each step

    @property
    def stop(self) -> int:
        return self.config.steps if self.until is None else min(self.until, self.config.steps)


@dataclass
class RankRun:
    """What a rank has after setup: its program, trainer and batches, where it starts."""

    plan: ExecutionPlan
    program: Program
    trainer: Trainer
    named: dict
    batches: RankBatches
    val: RankBatches | None
    counted: set[str]
    device: torch.device
    start: int = 0  # steps done before (a resumed run)
    best: dict | None = None  # the checkpoint with the lowest validation loss so far: {"step", "val_loss"}
    hooks: tuple = ()  # the after-step hooks (runtime/states.after_step)


def train_job(info, job: TrainJob) -> dict:
    """One rank of `fivedc train` in the worker pool: rank 0's rows go to the parent as JSON."""
    return train_rank(info, job, on_row=lambda row: info.report(json.dumps(row)))


def train_rank(info, job: TrainJob, *, on_row=None) -> dict:
    """Train this rank from its start to `job.stop`; rank 0's rows (also returned) go to `on_row`."""
    run = setup(info, job)
    rows = []
    for row in train_steps(run, job, info):
        rows.append(row)
        if on_row is not None and info.rank == 0:
            on_row(row)
    return {"rows": rows if info.rank == 0 else [], "held": run.trainer.optimizer.held_bytes()}


def train_steps(run: RankRun, job: TrainJob, info) -> Iterator[dict]:
    """The steps from `run.start` to `job.stop`, a row for each as it ends (every rank's
    own; rank 0's are the ones shown): the Ray launcher streams them as they come."""
    config, optimizer = job.config, run.trainer.optimizer
    batch, seq = token_shape(run.plan.graph)
    for step in range(run.start, job.stop):
        strike(job.faults, rank=info.rank, attempt=job.attempt, step=step + 1)
        start = time.perf_counter()
        loss = run.trainer.forward_backward(run.batches.at(step))
        norm = clip_grad_norm(optimizer, run.counted, config.clip)
        check_finite(step + 1, loss=loss, grad_norm=norm)  # the same on every rank: all stop
        optimizer.lr = config.lr_at(step)
        optimizer.step()
        run.trainer.end_step()
        after_step(run.program.ctx, written_keys(run.plan.graph), run.hooks)  # states summed over pp; hooks
        synchronize(optimizer.params)
        done = step + 1
        row = {"step": done, "loss": loss, "lr": optimizer.lr, "grad_norm": norm, "tokens": done * batch * seq,
               "seconds": time.perf_counter() - start}
        saving = job.save_dir is not None and (config.saves_at(done) or done == job.stop)
        if run.val is not None and (config.validates_at(done, saving=saving) or done == job.stop):
            row["val_loss"] = validate(run, config.val_batches)
            check_finite(done, val_loss=row["val_loss"])
        if saving:
            row["checkpoint"] = str(save(run, job, info, step=done, val_loss=row.get("val_loss")))
        yield row


def save(run: RankRun, job: TrainJob, info, *, step: int, val_loss: float | None) -> Path:
    """A checkpoint of this step (every rank); rank 0 then prunes old ones and, on a new
    best validation loss, writes best_model.safetensors."""
    from fivedc.runtime.checkpoint import prune, save_checkpoint

    config, optimizer = job.config, run.trainer.optimizer
    better = val_loss is not None and math.isfinite(val_loss) and (run.best is None or val_loss < run.best["val_loss"])
    if better:
        run.best = {"step": step, "val_loss": val_loss}
    batch, seq = token_shape(run.plan.graph)
    taken = next(iter(optimizer.state.values())).step if optimizer.state else step
    meta = {"step": step, "val_loss": val_loss, "best": run.best,
            "data": {"train": job.train.path, "dtype": job.train.dtype, "tokens": job.train_tokens, "batch": batch,
                     "seq": seq, "seed": config.seed, **run.batches.sampler.position(step)},
            "config": config.to_json(),
            "optimizer": {"kind": "adamw", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": config.weight_decay,
                          "lr": optimizer.lr, "steps_taken": taken},
            "names": job.names}
    midway = functools.partial(strike, job.faults, rank=info.rank, attempt=job.attempt, step=step, saving=True)
    folder = save_checkpoint(run, root=job.save_dir, step=step, meta=meta, rank=info.rank, world=info.world,
                             midway=midway)
    if info.rank == 0:
        prune(job.save_dir, keep=config.keep, best_step=run.best["step"] if run.best else None)
        if better:
            from fivedc.runtime.export import model_tensors, write_model
            from fivedc.runtime.checkpoint import read_index

            index = read_index(folder)
            write_model(Path(job.save_dir) / "best_model.safetensors", model_tensors(folder, index), index=index)
    return folder


def check_finite(step: int, **values: float) -> None:
    """Stop (exit 1) at a NaN or infinite loss or gradient norm: nothing of it is saved."""
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
        what = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in bad.items())
        raise NonFiniteError(f"step {step} reached a {what}: training stops, nothing of it is saved",
                             hint="lower --lr, or clip the gradients (--clip 1); the checkpoints before it are "
                             "intact")


def validate(run: RankRun, batches: int) -> float:
    """The mean full loss over the first `batches` batches of the validation file."""
    count = min(batches, run.val.sampler.steps_per_epoch)
    store = state_store(run.program.ctx)
    store.training = False  # an evaluation adds nothing to the states, as a module's `if self.training:`
    try:
        return sum(run.trainer.evaluate(run.val.at(k)) for k in range(count)) / count
    finally:
        store.training = True


def setup(info, job: TrainJob) -> RankRun:
    """This rank's program, its shards of the starting (or saved) parameters, its trainer
    and batches; a resumed run's optimizer state."""
    plan = job.plan
    graph, mesh = plan.graph, plan.mesh
    ctx = KernelContext(graph, mesh, mesh.coords(info.rank), _groups(plan, info))
    device = torch.device(info.device)
    named = dict(qualified_params(graph))
    held = chunk_param_names(graph, plan.pipeline, pp_rank=ctx.coords[MeshAxis.PP]) if plan.pipeline else set(named)
    settings = TrainSettings(lr=job.config.lr, weight_decay=job.config.weight_decay, seed=job.config.seed,
                             dtype=plan.dtype, keep_grads=False)
    with contextlib.ExitStack() as stack:
        reader = stack.enter_context(_reader(job)) if job.resume is not None else None
        if reader is not None:
            params = local_params(reader, named, held, ctx, settings.torch_dtype)
        else:
            full = _starting_params(job, settings, held, device)
            params = {n: shard(t, named[n].dims, named[n].sharding, ctx) for n, t in full.items()}
        program = Program(graph, ctx, recompute=plan.recompute)
        if job.states:  # the module's buffers (a resumed run reads the checkpoint's: restore_state)
            set_states(ctx, {k: t.detach().clone().to(device) for k, t in job.states.items()})
        trainer = Trainer(program, {n: t.to(device) for n, t in params.items()}, settings, zero=plan.zero,
                          buckets=plan.buckets, overlap=plan.overlap, pipeline=plan.pipeline)
        batch, seq = token_shape(graph)
        batches = RankBatches(job.train, Sampler(job.train_tokens, seq, batch, job.config.seed), graph, ctx, device)
        val = None
        if job.val is not None:
            val = RankBatches(job.val, Sampler(job.val_tokens, seq, batch, 0, shuffle=False), graph, ctx, device)
        counted = counted_params(named, params, ctx=ctx, zero=plan.zero, specs=trainer.optimizer.specs,
                                 shared=shared_instances(graph, plan.pipeline))
        run = RankRun(plan, program, trainer, named, batches, val, counted, device, hooks=_hooks(job.hooks))
        if reader is not None:
            restore_state(reader, run, rank=info.rank)
            run.start, run.best = reader.index["step"], reader.index.get("best")
    return run


def _hooks(spec: str | None) -> tuple:
    """The after-step hooks of a `file.py:factory` model: its module's `fivedc_after_step` (this rank
    builds the module to get them: a function of the factory's file does not pickle)."""
    if spec is None:
        return ()
    from fivedc.frontends.python_file import load_factory
    from fivedc.runtime.states import after_step_hooks

    module, _ = load_factory(spec)
    return after_step_hooks(module, None)


def _reader(job: TrainJob):
    from fivedc.runtime.checkpoint import read_index
    from fivedc.runtime.reshard import CheckpointReader

    index = read_index(job.resume)
    check_same_model(index, job.plan, where=job.resume)
    return CheckpointReader(job.resume, index)


def _starting_params(job: TrainJob, settings: TrainSettings, held: set[str], device: torch.device
                     ) -> dict[str, torch.Tensor]:
    """The full starting parameters this rank holds (some of), at the training dtype."""
    if isinstance(job.init, str):
        from safetensors import safe_open

        with safe_open(job.init, framework="pt") as file:
            return {n: file.get_tensor(n).to(settings.torch_dtype) for n in sorted(held)}
    if isinstance(job.init, dict):
        full = {n: t.detach().to(settings.torch_dtype) for n, t in job.init.items()}
        _broadcast_from_first(full, device)
        return {n: full[n] for n in sorted(held)}
    return init_params(job.plan.graph, seed=settings.seed, dtype=settings.torch_dtype, only=held)


def _broadcast_from_first(full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Rank 0's tensors on every rank (as DDP starts), one flat buffer per dtype."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in sorted(full):
        by_dtype.setdefault(full[name].dtype, []).append(name)
    for names in by_dtype.values():
        flat = torch.cat([full[n].reshape(-1) for n in names]).to(device)
        dist.broadcast(flat, src=0)
        for name, part in zip(names, flat.cpu().split([full[n].numel() for n in names])):
            full[name] = part.view(full[name].shape)


def _groups(plan: ExecutionPlan, info):
    """The process groups of the plan's mesh (None on one device outside a distributed job)."""
    import torch.distributed as dist

    from fivedc.runtime.groups import MeshGroups

    if not dist.is_initialized():
        return None
    axis_sets = {c.axes for c in plan.collectives}
    axis_sets |= {p.grad_partial for _, p in qualified_params(plan.graph) if p.grad_partial}
    axis_sets.add(loss_axes_of(plan.graph, plan.mesh))
    return MeshGroups(plan.mesh, device_type=info.device.split(":")[0], axis_sets=sorted(a for a in axis_sets if a),
                      pp_subsets=holder_sets(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP)))
