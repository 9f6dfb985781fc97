"""A rank's states (`fivedc/ir/states.py`): the module buffers the forward reads and adds to.

Each state is one whole tensor on every rank, kept by its module key on the `KernelContext`
(`StateStore`). Kernels read a state (`read_state`: the MoE routing bias) and add to it
(`add_to_state`: the MoE tokens per expert, already summed over the ranks that split the
batch); a forward in evaluation (the module not training) adds nothing, as the module's own
`if self.training:` does. Where `fivedc.parallelize` made the program, the tensors are the
parallel module's registered buffers themselves, so the after-step hooks and `state_dict()`
see them as they are.

Under a pipeline only the pp ranks whose chunks hold an op add to its states. `sum_over_pp`
(after the step, before the hooks) makes every rank's copy the one-device value: each adds
what it added since the last sum, all-reduced over pp, to the value at that sum (the same on
every rank), so a hook computes alike everywhere (the plan lists that all-reduce:
`fivedc/plan/state_sync.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import FivedcError
from fivedc.ir.mesh import MeshAxis


@dataclass
class StateStore:
    """The live state tensors by module key, and their values at the last sum over pp."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    summed: dict[str, Tensor] = field(default_factory=dict)
    training: bool = True


def state_store(ctx) -> StateStore:
    if "states" not in ctx._cache:
        ctx._cache["states"] = StateStore()
    return ctx._cache["states"]


def set_states(ctx, tensors: dict[str, Tensor]) -> None:
    """The states the program reads and adds to (the values they start from)."""
    store = state_store(ctx)
    store.tensors = dict(tensors)
    store.summed = {k: t.detach().clone() for k, t in tensors.items()}


def _tensor(ctx, key: str, like: Tensor, size: int) -> Tensor:
    """The state `key`; one nobody gave starts at zero (the plan carries no buffer values)."""
    store = state_store(ctx)
    if key not in store.tensors:
        zero = torch.zeros(size, dtype=like.dtype, device="cpu" if like.is_meta else like.device)
        store.tensors[key], store.summed[key] = zero, zero.clone()
    return store.tensors[key]


def read_state(ctx, key: str, like: Tensor, size: int) -> Tensor:
    """The state's value on `like`'s device (a rehearsal on meta reads a meta copy)."""
    return _tensor(ctx, key, like, size).to(like.device)


def add_to_state(ctx, key: str, value: Tensor) -> None:
    """state += value, in a training forward (a rehearsal's meta values add nothing)."""
    store = state_store(ctx)
    if not store.training or value.is_meta:
        return
    state = _tensor(ctx, key, value, value.numel())
    with torch.no_grad():
        state.add_(value.reshape(state.shape).to(device=state.device, dtype=state.dtype))


def sum_over_pp(ctx, keys: tuple[str, ...]) -> None:
    """Every pp rank's states the one-device value: what each added since the last sum, summed over pp."""
    store = state_store(ctx)
    keys = tuple(k for k in keys if k in store.tensors)
    group = ctx.group((MeshAxis.PP,)) if ctx.mesh.size(MeshAxis.PP) > 1 else None
    if group is not None and keys:
        added = torch.cat([(store.tensors[k].detach() - store.summed[k].to(store.tensors[k])).reshape(-1).double()
                           for k in keys])
        dist.all_reduce(added, group=group)
        offset = 0
        with torch.no_grad():
            for k in keys:
                t = store.tensors[k]
                t.copy_(store.summed[k].to(t) + added[offset:offset + t.numel()].view(t.shape).to(t))
                offset += t.numel()
    mark_summed(ctx)


def mark_summed(ctx) -> None:
    """The states as they are now are every rank's (after a sum, after the hooks changed them alike)."""
    store = state_store(ctx)
    store.summed = {k: t.detach().clone() for k, t in store.tensors.items()}


def after_step(ctx, written: tuple[str, ...], hooks: tuple) -> None:
    """What follows the optimizer's step in fivedc's own loop (`fivedc train`): the written states
    summed over pp, then each hook `fn(module)` on a module holding every state as a buffer under
    its key (the tensors themselves), under no_grad, as `ParallelModule.after_step` runs them."""
    sum_over_pp(ctx, written)
    if hooks:
        holder = state_module(state_store(ctx).tensors)
        with torch.no_grad():
            for hook in hooks:
                hook(holder)
    mark_summed(ctx)


def state_module(tensors: dict[str, Tensor]):
    """An `nn.Module` whose buffers are `tensors` by their keys (`a.b.c`: buffer `c` of child `b` of `a`)."""
    from torch import nn

    root = nn.Module()
    for key, tensor in tensors.items():
        *path, leaf = key.split(".")
        holder = root
        for part in path:
            if part not in holder._modules:
                holder.add_module(part, nn.Module())
            holder = holder._modules[part]
        holder.register_buffer(leaf, tensor)
    return root


def after_step_hooks(module, given) -> tuple:
    """The after-step hooks: `after_step=` (a callable or a tuple of them), else the module's own
    `fivedc_after_step` attribute (as a factory sets it), else none."""
    hooks = given if given is not None else getattr(module, "fivedc_after_step", None)
    hooks = () if hooks is None else tuple(hooks) if isinstance(hooks, (tuple, list)) else (hooks,)
    for hook in hooks:
        if not callable(hook):
            raise FivedcError(f"after_step takes functions fn(model), not {type(hook).__name__}",
                              hint="after_step=fn, where fn(model) updates model's buffers after optimizer.step()")
    return hooks
