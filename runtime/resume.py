"""A rank restarted from a checkpoint: its shards of the parameters and of the optimizer state.

The plan of the resumed run may differ from the one that saved (another mesh, ZeRO
stage, pipeline, sequence layout, expert placement): every rank reads the blocks
it holds now through `runtime/reshard.CheckpointReader`, whatever blocks the saving
ranks held. Parameters come back as full local tensors (the trainer chunks them
for ZeRO-3, as it does fresh ones); AdamW's moments and the fp32 master go into
the owned chunk of the optimizer state (the whole local tensor without ZeRO), and
its step count is the checkpoint's. MoE balancing biases come back whole. A rank's
RNG state is restored only when the layout is the one that saved (the same world
and plan hash): after a reshard rank r is not the rank r that saved.
"""

from __future__ import annotations

import math

import torch

from fivedc.errors import FivedcError
from fivedc.runtime.checkpoint import STATES, plan_hash, rank_file
from fivedc.runtime.moe import moe_state
from fivedc.runtime.states import set_states
from fivedc.runtime.reshard import CheckpointReader, block_of


SAME_MODEL = "resume with the model that saved it (another mesh or options are fine)"


def check_same_model(index: dict, plan, *, where: str) -> None:
    """The checkpoint holds exactly the plan's parameters, at the same global shapes."""
    graph = plan.graph
    from fivedc.runtime.program import qualified_params

    want = {name: [graph.dim(d) for d in p.dims] for name, p in qualified_params(graph)}
    have = {key[len("param/"):]: entry["shape"] for key, entry in index["tensors"].items() if key.startswith("param/")}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing or extra:
        parts = ([f"it lacks {', '.join(missing[:5])}"] if missing else []) + \
                ([f"it has {', '.join(extra[:5])}, which the model has not"] if extra else [])
        raise FivedcError(f"the checkpoint {where} is of another model than {graph.name}: {'; '.join(parts)}",
                          hint=SAME_MODEL)
    for name in sorted(want):
        if want[name] != have[name]:
            raise FivedcError(f"the checkpoint {where} holds {name} of shape {have[name]}; the model's is {want[name]}",
                              hint=SAME_MODEL)
    _check_states(index, plan, where=where)
    _check_moe_biases(index, plan, where=where)


def _check_states(index: dict, plan, *, where: str) -> None:
    """A state the checkpoint holds is one of the model's, with its elements (`fivedc/ir/states.py`)."""
    from fivedc.ir.states import state_sizes

    want = state_sizes(plan.graph)
    for key, entry in index["tensors"].items():
        if not key.startswith("state/"):
            continue
        name, elements = key[len("state/"):], math.prod(entry.get("shape") or [0])
        if name not in want:
            raise FivedcError(f"the checkpoint {where} holds the buffer {name}, which the model does not use",
                              hint=SAME_MODEL)
        if elements != want[name]:
            raise FivedcError(f"the checkpoint {where} holds the buffer {name} of {elements} elements; the model's "
                              f"has {want[name]}", hint=SAME_MODEL)


def _check_moe_biases(index: dict, plan, *, where: str) -> None:
    """A saved MoE balancing bias (`moe_bias/PREFIX.OUT`) is one of a balancing moe op's, with
    its experts: the layer's prefix and the op's output name, [experts] (`runtime/moe.py`)."""
    from fivedc.ir.graph import Op, walk_ops, walk_params

    graph = plan.graph
    experts = {}
    for op, _ in walk_ops(graph.body):
        if isinstance(op, Op) and op.kind == "moe" and float(op.attr("bias_update", 0.0) or 0.0):
            router = next(p for p, _ in walk_params(graph.body) if p.name == op.args[1])
            experts[op.out] = graph.dim(router.dims[1])
    for key, entry in index["tensors"].items():
        if not key.startswith("moe_bias/"):
            continue
        name = key[len("moe_bias/"):]
        out = name.rpartition(".")[2]
        if out not in experts or list(entry.get("shape") or []) != [experts[out]]:
            raise FivedcError(f"the checkpoint {where} holds a balancing bias {name} of shape {entry.get('shape')}, "
                              "which no balancing MoE layer of the model has",
                              hint=SAME_MODEL)


def local_params(reader: CheckpointReader, named: dict, held: set[str], ctx, dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter it holds, read from the checkpoint."""
    return {name: reader.read(f"param/{name}", block_of(named[name].dims, named[name].sharding, ctx), dtype)
            for name in sorted(held)}


def restore_state(reader: CheckpointReader, run, *, rank: int) -> None:
    """AdamW's state, the MoE biases and (same layout only) the RNG state of this rank."""
    optimizer, ctx, index = run.trainer.optimizer, run.program.ctx, reader.index
    steps = index["optimizer"]["steps_taken"]
    for name, state in optimizer.state.items():
        param, spec = run.named[name], optimizer.specs[name]
        block = block_of(param.dims, param.sharding, ctx)
        for kind in STATES:
            mine = getattr(state, kind)
            key = f"{kind}/{name}" if reader.has(f"{kind}/{name}") else f"param/{name}" if kind == "master" else None
            if mine is None or key is None or not reader.has(key):
                continue
            local = reader.read(key, block, mine.dtype).reshape(-1)
            owned = spec.owned(local) if optimizer.stage >= 1 else local
            mine.zero_()
            mine[:owned.numel()] = owned
        state.step = steps
    for key in index["tensors"]:
        if key.startswith("moe_bias/"):
            entry = index["tensors"][key]
            bias = reader.read(key, tuple(((0, n),) for n in entry["shape"]), getattr(torch, entry["dtype"]))
            moe_state(ctx).bias[key[len("moe_bias/"):]] = bias.to(run.device)
    states = {key[len("state/"):]: reader.read(key, tuple(((0, n),) for n in entry["shape"]),
                                               getattr(torch, entry["dtype"])).to(run.device)
              for key, entry in index["tensors"].items() if key.startswith("state/")}
    if states:  # the module's buffers the forward uses, whole on every rank
        set_states(ctx, states)
    if index["world"] == ctx.mesh.world and index["plan"]["hash"] == plan_hash(run.plan):
        torch.set_rng_state(reader.file_tensor(rank_file(rank), "rng/torch"))
