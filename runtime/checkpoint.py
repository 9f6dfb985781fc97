"""Checkpoints: every rank's shards as safetensors, one JSON index, committed atomically.

A save directory holds committed checkpoints `step-00000020/` (an `index.json` and
one `rank-00003.safetensors` per rank), at most `keep` of them besides the one with
the best validation loss, and `best_model.safetensors`, that best one consolidated
into one file with the model's own parameter names (`runtime/export.py`).

What a rank writes: for each parameter it holds, its value and AdamW's two moments
(and the fp32 master in 16-bit training) as pieces: the rank's whole block of the
tensor (the global indices of each dim it holds: `runtime/reshard.py`), or under
ZeRO its flat chunk of that block. A piece held alike by several ranks (replicas
over dp, over tp for a norm weight, a tied weight's copies on several pp ranks, ...)
is written by the first of them only (`first_holder`); a MoE layer's balancing bias likewise; the
states (a module's buffers the forward uses: `state/KEY`, whole, alike everywhere after a step) by rank 0;
each rank's RNG state is its own. The safetensors header lists the rank's pieces.

Commit: every rank writes into `.tmp-step-N/` and fsyncs its file; after a barrier
rank 0 reads the headers (no tensor data), checks that the pieces of every tensor
cover it exactly, writes `index.json` (global shape, dims and sharding of every
tensor, where its pieces are; the plan's hash and mesh; step, data position, the
training settings, optimizer settings, validation loss, the best so far, the
model's parameter names), fsyncs, and renames the folder to `step-N/`. A crash at
any point before the rename leaves only a `.tmp-` folder, which nothing reads: the
previous checkpoint is intact. Loading reads JSON and safetensors, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fivedc.errors import CheckpointError, NonFiniteError
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.tied import shared_instances
from fivedc.runtime.moe import moe_state
from fivedc.runtime.states import state_store
from fivedc.runtime.checkpoint_dirs import INDEX, STEP_DIR, committed, find_checkpoint, step_dir  # noqa: F401
from fivedc.runtime.reshard import as_block, block_of, block_text, first_holder, shape_of, whole

FORMAT, VERSION = "fivedc-checkpoint", 1
STATES = ("exp_avg", "exp_avg_sq", "master")  # AdamW's moments and the 16-bit master copy


def read_index(folder: str | Path) -> dict:
    """The index of a checkpoint folder, every field type-checked (`checkpoint_check.py`):
    a checkpoint is untrusted input."""
    from fivedc.runtime.checkpoint_check import check_index
    from fivedc.runtime.checkpoint_dirs import damaged_hint
    from fivedc.runtime.checkpoint_files import check_digest_field

    path = Path(folder) / INDEX
    hint = damaged_hint(Path(folder))
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise CheckpointError(f"cannot read the checkpoint index {path}: {error}", hint=hint) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a fivedc checkpoint index (no \"format\": \"{FORMAT}\")", hint=hint)
    if index.get("version") != VERSION:
        raise CheckpointError(f"{path} is a version {index.get('version')!r} checkpoint; this fivedc reads version "
                              f"{VERSION}", hint=hint)
    check_index(index, path)
    check_digest_field(index.get("files"), lambda field, what: _bad_field(path, field, what))
    return index


def _bad_field(path: Path, field: str, what: str):
    from fivedc.runtime.checkpoint_dirs import damaged_hint

    raise CheckpointError(f"the checkpoint index {path}: {field} {what}", hint=damaged_hint(path.parent))


def plan_hash(plan) -> str:
    from fivedc.ir.serialize import encode

    return hashlib.sha256(json.dumps(encode(plan), sort_keys=True).encode()).hexdigest()[:16]


# ---- what a rank writes ----------------------------------------------------------------
def rank_pieces(run) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This rank's tensors to write (key -> tensor) and the piece each is (key -> block, flat)."""
    optimizer, ctx = run.trainer.optimizer, run.program.ctx
    shared = shared_instances(run.plan.graph, run.plan.pipeline)  # copies on several pp ranks: the first writes
    tensors, pieces = {}, {}

    def put(key, value, block, flat, chunked, name):
        if first_holder(run.named[name], ctx, chunked=chunked, pp_ranks=shared.get(name, ())):
            tensors[key] = value.detach().contiguous().cpu()
            pieces[key] = {"block": block_text(block), "flat": flat, "dtype": str(value.dtype).removeprefix("torch.")}

    for name, p in optimizer.params.items():
        param, spec, state = run.named[name], optimizer.specs[name], optimizer.state[name]
        block = block_of(param.dims, param.sharding, ctx)
        shape, chunk = shape_of(block), spec.n > 1
        flat = [spec.index * spec.chunk, spec.index * spec.chunk + spec.owned_length] if chunk else None
        if optimizer.stage == 3 and chunk:
            put(f"param/{name}", p[:spec.owned_length], block, flat, True, name)
        else:
            put(f"param/{name}", p.view(shape), block, None, False, name)
        for kind in STATES:
            value = getattr(state, kind)
            if value is None:
                continue
            if optimizer.stage >= 1 and chunk:
                put(f"{kind}/{name}", value[:spec.owned_length], block, flat, True, name)
            else:
                put(f"{kind}/{name}", value[:spec.numel].view(shape), block, None, False, name)
    if all(c == 0 for a, c in ctx.coords.items() if a != MeshAxis.PP):  # a MoE bias is the same on every rank
        for name, bias in moe_state(ctx).bias.items():
            tensors[f"moe_bias/{name}"] = bias.detach().cpu().clone()
            pieces[f"moe_bias/{name}"] = {"block": block_text(whole(tuple(bias.shape))), "flat": None,
                                          "dtype": str(bias.dtype).removeprefix("torch.")}
    if all(c == 0 for c in ctx.coords.values()):  # the states: whole and alike on every rank after the step
        for key, value in state_store(ctx).tensors.items():
            tensors[f"state/{key}"] = value.detach().cpu().clone()
            pieces[f"state/{key}"] = {"block": block_text(whole(tuple(value.shape))), "flat": None,
                                      "dtype": str(value.dtype).removeprefix("torch.")}
    tensors["rng/torch"] = torch.get_rng_state()
    return tensors, pieces


def save_checkpoint(run, *, root: str | Path, step: int, meta: dict, rank: int, world: int,
                    midway=None) -> Path:
    """Write this rank's pieces and (rank 0) commit the checkpoint of step `step`; a
    collective: every rank calls it. `meta` goes into the index as it is; `midway()` runs
    once this rank's shard is written, before the commit (the fault tests die there)."""
    from safetensors.torch import save_file

    from fivedc.runtime.checkpoint_files import record_digest

    root = Path(root)
    tmp, final = root / f".tmp-{step_dir(root, step).name}", step_dir(root, step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    tensors, pieces = rank_pieces(run)
    _check_finite(tensors, step, run.device)
    path = tmp / rank_file(rank)
    save_file(tensors, str(path), metadata={"fivedc": json.dumps({"rank": rank, "pieces": pieces})})
    _fsync(path)
    record_digest(path)
    if midway is not None:
        midway()
    _barrier()
    if rank == 0:
        index = build_index(run, tmp, world=world, meta=meta)
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        _fsync(tmp / INDEX)
        _commit(tmp, final)
    _barrier()
    return final


def _check_finite(tensors: dict[str, torch.Tensor], step: int, device: torch.device) -> None:
    """Every rank's state finite, or no rank writes (agreed over the world, so none waits)."""
    bad = [key for key, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    flag = torch.tensor([float(len(bad))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag)
    if flag.item():
        where = f" ({', '.join(bad[:3])} on this rank)" if bad else " (on another rank)"
        raise NonFiniteError(f"step {step}'s state holds NaN or infinite values{where}: no checkpoint is written",
                             hint="lower --lr or clip the gradients (--clip 1); resume from an earlier checkpoint")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def build_index(run, folder: Path, *, world: int, meta: dict) -> dict:
    """The index of a checkpoint folder from its rank files' headers and the plan."""
    from safetensors import safe_open

    from fivedc.runtime.checkpoint_files import collect_digests

    plan, graph = run.plan, run.plan.graph
    tensors: dict[str, dict] = {}
    for rank in range(world):
        with safe_open(str(folder / rank_file(rank)), framework="pt") as file:
            header = json.loads(file.metadata()["fivedc"])
        for key, piece in header["pieces"].items():
            entry = tensors.setdefault(key, {"dtype": piece["dtype"], "pieces": []})
            entry["pieces"].append({"file": rank_file(rank), "key": key, "block": piece["block"],
                                    "flat": piece["flat"]})
    for key, entry in tensors.items():
        kind, name = key.split("/", 1)
        if kind == "moe_bias":
            entry.update(shape=list(shape_of(_block(entry["pieces"][0]))), dims=["experts"], sharding="")
        elif kind == "state":  # a module buffer (fivedc/ir/states.py), whole
            shape = list(shape_of(_block(entry["pieces"][0])))
            entry.update(shape=shape, dims=[f"dim{i}" for i in range(len(shape))], sharding="")
        else:
            param = run.named[name]
            entry.update(shape=[graph.dim(d) for d in param.dims], dims=list(param.dims),
                         sharding=str(param.sharding or ""))
        _check_cover(key, entry)
    return {"format": FORMAT, "version": VERSION, **meta, "world": world,
            "plan": {"hash": plan_hash(plan), "model": graph.name, "mesh": str(plan.mesh),
                     "rank_order": [str(a) for a in plan.mesh.rank_order], "zero": plan.zero, "dtype": plan.dtype,
                     "sequence_parallel": plan.sequence_parallel,
                     "schedule": plan.pipeline.schedule if plan.pipeline else None},
            "rng": "rng/torch in each rank's file (torch.get_rng_state)",
            "files": collect_digests(folder, [rank_file(r) for r in range(world)]),
            "tensors": dict(sorted(tensors.items()))}


def _block(piece: dict):
    return as_block(piece["block"])


def _check_cover(key: str, entry: dict) -> None:
    """The pieces of a tensor hold each of its elements once (counted): else a bug in the writers."""
    total = 0
    for piece in entry["pieces"]:
        total += piece["flat"][1] - piece["flat"][0] if piece["flat"] else _numel(shape_of(_block(piece)))
    want = _numel(tuple(entry["shape"]))
    if total != want:
        raise RuntimeError(f"checkpoint pieces of {key} hold {total} elements, the tensor has {want}")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _commit(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place (replacing an earlier save of the same step)."""
    _fsync(tmp)
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def prune(root: str | Path, *, keep: int, best_step: int | None) -> list[int]:
    """Remove committed checkpoints but the last `keep` and the best (each renamed out of
    sight before its files go: `--resume auto` never finds one half removed); and stale
    temp folders.
    Returns the steps removed."""
    found = committed(root)
    kept = {step for step, _ in found[-keep:]} | ({best_step} if best_step is not None else set())
    removed = []
    for step, path in found:
        if step not in kept:  # renamed first: a crash mid-removal never leaves a committed name half gone
            gone = path.with_name(f".old-{path.name}")
            shutil.rmtree(gone, ignore_errors=True)
            path.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)
            removed.append(step)
    for stale in (*Path(root).glob(".tmp-step-*"), *Path(root).glob(".old-step-*")):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a directory on a file system that cannot sync one
        pass
    finally:
        os.close(fd)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
