"""The module `fivedc.parallelize` returns: this rank's shards, run by fivedc's runtime.

`ParallelModule` holds one `nn.Parameter` per parameter of the original module that
this rank holds, under the module's own key (`layers.0.attn.q_proj.weight`; a tied one
under each of its keys, named once by `named_parameters()`, as torch does): this rank's
block of the module's tensor, in the module's layout. The plan's parameters
(`layers.0.wq`, a linear's weight [in, out]) are views of them, made at each forward
(`fivedc/parallel/names.py`). Persistent buffers, and parameters forward never reads,
are kept whole under their keys, so `state_dict()` has the module's keys.

`forward` takes the same arguments as the original module's, with FULL global
tensors (every rank passes the same batch); it cuts this rank's shard (batch over
dp, sequence over cp in the plan's layout), runs the plan's `Program`, and returns
the full loss: the local summand all-reduced over the loss's pending axes, with an
identity backward, so `loss.backward()` seeds each rank's own summand. Gradients are
summed over their `grad_partial` axes before `backward()` returns
(`fivedc/parallel/grads.py`), so a plain `torch.optim` optimizer over `parameters()`
trains it. Under ZeRO the parameters are the owned chunks of the flattened shards
instead (still under the module's keys), and the forward gathers them
(`fivedc/parallel/weights.py`); under a pipeline a rank holds only its chunks'
parameters, and the forward runs the whole schedule (`fivedc/parallel/pipeline.py`).
`full_state_dict()` gathers the parameters back into whole tensors (with the
persistent buffers) and `load_state_dict` takes either form, told apart by shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fivedc.errors import FivedcError
from fivedc.frontends.fx.params import module_state
from fivedc.frontends.fx_module import TracedModel
from fivedc.ir.graph import Param
from fivedc.ir.states import state_sizes, written_keys
from fivedc.ir.mesh import MeshAxis
from fivedc.parallel.grads import GradSync
from fivedc.parallel.names import held_names
from fivedc.parallel.pipeline import PipelineLoss
from fivedc.parallel.weights import GatheredOnUse, make_weights
from fivedc.passes.tied import holder_sets
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.collectives import Step, apply_steps, redistribute
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.moe import end_step, register_gathered, register_params
from fivedc.runtime.program import Program, qualified_params, shard
from fivedc.runtime.states import mark_summed, set_states, state_store, sum_over_pp
from fivedc.runtime.train import loss_axes_of, loss_partial_axes


class ParallelModule(nn.Module):
    """One rank's part of a module parallelized by fivedc (see `fivedc.parallelize`)."""

    def __init__(self, module: nn.Module, traced: TracedModel, plan: ExecutionPlan, *, example_inputs,
                 device: torch.device, sync_module_states: bool = True, compile: bool | str = False,
                 after_step: tuple = ()) -> None:
        super().__init__()
        self.fivedc_plan = plan
        self.fivedc_traced = traced
        self._fivedc_name = type(module).__name__
        self._fivedc_signature = inspect.signature(module.forward)
        self._fivedc_fixed = _fixed_arguments(self._fivedc_signature, example_inputs)
        self._fivedc_device = device
        self._fivedc_groups = _mesh_groups(plan, device)
        rank = dist.get_rank() if self._fivedc_groups is not None else 0
        self._fivedc_ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(rank), self._fivedc_groups)
        self._fivedc_program = Program(plan.graph, self._fivedc_ctx, recompute=plan.recompute, compile=compile)
        self._fivedc_specs: dict[str, Param] = dict(qualified_params(plan.graph))
        state = module_state(module)  # by the names the tracer saw, whatever the module's state-dict hooks write
        keys = {m.key for m in traced.params}
        self._fivedc_keys = tuple(state)  # the original order, parameters and persistent buffers
        full = traced.to_ir_params(state)
        if sync_module_states and self._fivedc_groups is not None:
            _broadcast(full, device)
        held = self._fivedc_specs
        if plan.pipeline is not None:  # this rank's chunks' parameters only
            self._fivedc_pipeline = PipelineLoss(self._fivedc_program, plan, device)
            held = {n: spec for n, spec in held.items() if n in self._fivedc_pipeline.mine}
        else:
            self._fivedc_pipeline = None
        self._fivedc_names = held_names(traced.params, plan, self._fivedc_ctx, held, self._fivedc_keys)
        local = {name: shard(full[name].detach(), spec.dims, spec.sharding, self._fivedc_ctx).to(device)
                 for name, spec in held.items()}
        frozen = {key for key in self._fivedc_names.shapes if not module.get_parameter(key).requires_grad}
        self._fivedc_weights = make_weights(self._fivedc_names.to_held(local), frozen, plan, self._fivedc_names,
                                            self._fivedc_names.grouping(plan, self._fivedc_ctx))
        self._fivedc_register(state, keys)
        self._fivedc_hooks = tuple(after_step)
        self._fivedc_init_states(module, sync_module_states)
        axes = loss_partial_axes(plan.graph)
        self._fivedc_loss_steps = (Step("all_reduce", axes),) if axes and self._fivedc_groups is not None \
            and plan.mesh.size(*axes) > 1 else ()

    @property
    def _fivedc_grads(self) -> GradSync | None:
        """The gradient sum of the last forward (ZeRO-0: of every forward)."""
        return getattr(self._fivedc_weights, "sync", None)

    # ---- training ---------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> Tensor:
        """The full loss of the model on the global batch given (every rank passes the same)."""
        inputs = self._fivedc_inputs(args, kwargs)
        end_step(self._fivedc_ctx)  # MoE: drop the previous call's token counts (no bias update is lowered)
        state_store(self._fivedc_ctx).training = self.training  # a module's state gains only in training
        weights = self._fivedc_weights
        if self._fivedc_pipeline is not None:  # its microbatches' backward runs in here
            with weights.scope():  # what autograd keeps: gathered values as notes, as `fivedc train`
                return self._fivedc_pipeline.loss(weights.view(), inputs)
        with weights.scope():
            view = weights.view()
            if isinstance(view, dict):
                register_params(self._fivedc_ctx, view)  # MoE layers name their state by their router
            elif isinstance(weights, GatheredOnUse):  # ZeRO-3: gathered by group, named by their sharded params
                register_gathered(self._fivedc_ctx, weights.sharded.name_of)
            loss = self._fivedc_program.loss(view, inputs)
        weights.forward_done(view)
        if self._fivedc_loss_steps:
            loss = redistribute(loss, self._fivedc_loss_steps, (), self._fivedc_groups)
        return loss

    def _fivedc_inputs(self, args: tuple, kwargs: dict) -> dict[str, Tensor]:
        try:
            bound = self._fivedc_signature.bind(*args, **kwargs)
        except TypeError as error:
            raise FivedcError(f"{self._fivedc_name} (parallelized) called with wrong arguments: {error}") from None
        bound.apply_defaults()
        for name, traced in self._fivedc_fixed.items():
            if not _same(bound.arguments.get(name), traced):
                raise FivedcError(
                    f"{self._fivedc_name} (parallelized) was traced with {name}={traced!r}, got "
                    f"{bound.arguments.get(name)!r}",
                    hint="arguments that are not tensors are fixed when the module is traced; "
                    "parallelize again with example inputs that have the new value",
                )
        graph, out = self.fivedc_plan.graph, {}
        for item in graph.inputs:
            value = bound.arguments.get(item.name)
            shape = tuple(graph.dim(d) for d in item.type.dims)
            if isinstance(value, Tensor) and _merges(tuple(value.shape), shape):
                value = value.reshape(shape)  # a dim the model cuts in several (`ids.view(b, 2, n // 2)`)
            if not isinstance(value, Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise FivedcError(
                    f"{self._fivedc_name} (parallelized) was traced with {item.name} of shape {shape}, got {got}",
                    hint="the plan is compiled for the example inputs' shapes: pass full global tensors of that "
                    "shape on every rank, or parallelize again with example inputs of the new shape",
                )
            out[item.name] = shard(value, item.type.dims, item.sharding, self._fivedc_ctx).to(self._fivedc_device)
        return out

    def after_step(self) -> None:
        """Call after `optimizer.step()` (every rank): the states the forward added to (the module's
        buffers it writes, `fivedc/ir/states.py`) are summed over the pipeline's ranks, so every rank
        holds the one-device value, then the after-step hooks (`parallelize(..., after_step=fn)`) run
        as `fn(model)` under `torch.no_grad()` on this module, whose buffers have the module's keys."""
        ctx = self._fivedc_ctx
        sum_over_pp(ctx, written_keys(self.fivedc_plan.graph))
        with torch.no_grad():
            for hook in self._fivedc_hooks:
                hook(self)
        mark_summed(ctx)

    def full_states(self) -> dict[str, Tensor]:
        """The states (the module's buffers the forward reads or writes), whole, by their keys (every rank)."""
        sum_over_pp(self._fivedc_ctx, written_keys(self.fivedc_plan.graph))
        tensors = state_store(self._fivedc_ctx).tensors
        return {k: tensors[k].detach().cpu().clone() for k in state_sizes(self.fivedc_plan.graph)}

    # ---- state dicts ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Tensor]:
        """The original module's state dict, gathered (a collective: call it on every rank)."""
        weights = self._fivedc_weights
        local = self._fivedc_names.to_ir({k: weights.local(k) for k in weights.params})
        params = self.fivedc_traced.from_ir_params(self._fivedc_gather(local))
        merged = {**self._fivedc_state(), **params}
        for alias, key in self._fivedc_aliases.items():  # a tied parameter under each of its names
            merged[alias] = merged[key]
        return {k: merged[k] for k in self._fivedc_keys if k in merged}

    def full_grads(self) -> dict[str, Tensor]:
        """Every parameter's gradient, gathered, in the original module's parameter names (collective)."""
        weights = self._fivedc_weights
        local = self._fivedc_names.to_ir({k: weights.local_grad(k) for k in weights.params})
        return self.fivedc_traced.from_ir_params(self._fivedc_gather(local))

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load the original module's (full) state dict: each rank keeps its shards."""
        ir = self.fivedc_traced.to_ir_params(dict(state_dict))
        names = self._fivedc_names
        local = {}
        for name in names.pieces:
            spec = self._fivedc_specs[name]
            local[name] = shard(ir[name], spec.dims, spec.sharding, self._fivedc_ctx)
        for key, tensor in names.to_held(local).items():
            self._fivedc_weights.load_local(key, tensor)
        state = self.state_dict(keep_vars=True)
        with torch.no_grad():
            for key in self._fivedc_own:
                if key in state_dict:
                    state[key].copy_(state_dict[key])
        self._fivedc_bind_states()

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True, assign: bool = False):
        """This rank's state dict (`state_dict()`: its shards) or the full one (the original
        module's, as `full_state_dict()` gives): both are in the module's keys, told apart by
        their shapes."""
        if self._fivedc_is_full(state_dict):
            self.load_full_state_dict(state_dict)
            return torch.nn.modules.module._IncompatibleKeys([], [])
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._fivedc_bind_states()
        return result

    def _fivedc_is_full(self, state_dict: Mapping[str, Tensor]) -> bool:
        """Whether `state_dict` holds every parameter whole (a rank's own shards are whole only
        where nothing splits them: then both readings load the same)."""
        whole = {m.key: m.key_shape for m in self.fivedc_traced.params}
        return bool(state_dict) and all(k in state_dict and tuple(state_dict[k].shape) == shape
                                        for k, shape in whole.items())

    def extra_repr(self) -> str:
        """`GPT, mesh 2x1x2x1x1, this rank at dp=0 pp=0 tp=1 cp=0 ep=0`."""
        coords = " ".join(f"{axis}={index}" for axis, index in self._fivedc_ctx.coords.items())
        return f"{self._fivedc_name}, mesh {self.fivedc_plan.mesh}, this rank at {coords}"

    # ---- internals --------------------------------------------------------------------
    def _fivedc_register(self, state: dict[str, Tensor], mapped: set[str]) -> None:
        """Each held tensor under its module key (a tied one under each of its keys, so
        `named_parameters()` names it once, by its first, as torch does), in the module's
        order, with what the plan does not hold (persistent buffers, and parameters forward
        never reads: whole, as they were): `state_dict()` has the module's keys."""
        held = self._fivedc_weights.params
        primary = {id(state[key]): key for key in held}
        planned = {id(state[key]) for key in mapped}  # the plan's, held on this rank or on another
        self._fivedc_aliases: dict[str, str] = {}
        own = []
        for key, tensor in state.items():
            if key in held:
                self._fivedc_put(key, held[key])
            elif id(tensor) in primary:
                self._fivedc_aliases[key] = primary[id(tensor)]
                self._fivedc_put(key, held[primary[id(tensor)]])
            elif id(tensor) not in planned:
                own.append(key)
                copy = tensor.detach().clone().to(self._fivedc_device)
                parameter = isinstance(tensor, nn.Parameter)
                self._fivedc_put(key, nn.Parameter(copy, tensor.requires_grad) if parameter else copy)
        self._fivedc_own = tuple(own)  # outside the plan, whole on every rank

    def _fivedc_init_states(self, module: nn.Module, sync: bool) -> None:
        """The module's buffers the plan reads or adds to (`fivedc/ir/states.py`): whole on every rank
        (rank 0's, as the weights), registered under their keys (as the module registers them), and the
        program's states (`runtime/states.py`)."""
        values = self.fivedc_traced.state_values(module)
        if sync and self._fivedc_groups is not None and values:
            _broadcast(values, self._fivedc_device)
        own = set(self._fivedc_own)
        for key, value in values.items():
            if key in own:
                with torch.no_grad():
                    self.get_buffer(key).copy_(value)
            else:
                persistent = key.rpartition(".")[2] not in _owner(module, key)._non_persistent_buffers_set
                self._fivedc_put(key, value.to(self._fivedc_device), persistent=persistent)
        self._fivedc_bind_states()

    def _fivedc_bind_states(self) -> None:
        """The program's states are this module's buffers (as they are now: loaded ones are every rank's,
        not additions to sum over pp; `assign=True` gives new tensors)."""
        set_states(self._fivedc_ctx, {key: self.get_buffer(key) for key in state_sizes(self.fivedc_plan.graph)})

    def _fivedc_put(self, key: str, tensor: Tensor, *, persistent: bool = True) -> None:
        """`layers.0.attn.wq.weight` as `weight` of a child `wq` of ... of a child `layers`."""
        *path, leaf = key.split(".")
        holder: nn.Module = self
        for part in path:
            child = holder._modules.get(part)
            if child is None:
                child = nn.Module()
                holder.add_module(part, child)
            holder = child
        try:
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(leaf, tensor)
            else:
                holder.register_buffer(leaf, tensor, persistent=persistent)
        except KeyError as error:
            raise FivedcError(f"the module's {key} clashes with an attribute of nn.Module: {error}",
                              hint="rename the module that holds it") from None

    def _fivedc_state(self) -> dict[str, Tensor]:
        """What the plan does not hold, as it is now (on the CPU, as gathered tensors are)."""
        state = self.state_dict(keep_vars=True)
        return {k: state[k].detach().cpu().clone() for k in self._fivedc_own}

    def _fivedc_gather(self, local: dict[str, Tensor]) -> dict[str, Tensor]:
        """Full tensors from this rank's shards: all-gather each split dim, undo its storage
        order (the sequence layout, an expert placement)."""
        ctx, out = self._fivedc_ctx, {}
        for name, tensor in local.items():
            spec = self._fivedc_specs[name]
            full = tensor
            for index, dim in enumerate(spec.dims):
                axes = spec.sharding.axes_of(dim)
                if axes and self._fivedc_groups is not None:
                    full = apply_steps(full, (Step("all_gather", axes, index),), self._fivedc_groups)
                order = ctx.storage_order(dim, spec.sharding)
                if order is not None:
                    full = full.index_select(index, torch.argsort(order).to(full.device))
            out[name] = full.cpu() if full is tensor else full.detach().cpu()
        if self._fivedc_pipeline is not None:
            out = self._fivedc_pipeline.share(out, self._fivedc_specs)
        return out


def _owner(module: nn.Module, key: str) -> nn.Module:
    """The submodule holding the buffer `key`."""
    return module.get_submodule(key.rpartition(".")[0])


def _fixed_arguments(signature: inspect.Signature, example) -> dict[str, object]:
    """The forward's non-tensor arguments in the example: the trace fixed them."""
    bound = signature.bind(**example) if isinstance(example, dict) else signature.bind(*example)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if not isinstance(v, Tensor)}


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a comparison that is not a bool (arrays): only identity counts
        return False


def _mesh_groups(plan: ExecutionPlan, device: torch.device):
    """The process groups of the plan's mesh; None on a one-rank mesh outside a distributed job."""
    from fivedc.runtime.groups import MeshGroups

    if not dist.is_initialized():
        return None
    axis_sets = {c.axes for c in plan.collectives}
    axis_sets |= {p.grad_partial for _, p in qualified_params(plan.graph) if p.grad_partial}
    axis_sets |= {p.sharding.axes_of(d) for _, p in qualified_params(plan.graph) for d in p.dims}
    axis_sets |= {loss_axes_of(plan.graph, plan.mesh)}
    if written_keys(plan.graph) and plan.mesh.size(MeshAxis.PP) > 1:
        axis_sets |= {(MeshAxis.PP,)}  # the states' sum over pp (runtime/states.py)
    return MeshGroups(plan.mesh, device_type=device.type, axis_sets=sorted(a for a in axis_sets if a),
                      pp_subsets=holder_sets(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP)))


def _broadcast(full: dict[str, Tensor], device: torch.device) -> None:
    """Rank 0's initial parameters on every rank (as DDP does), one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in full.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        flat = torch.cat([full[n].detach().reshape(-1) for n in names]).to(device)
        dist.broadcast(flat, src=0)
        offset = 0
        for n in names:
            size = full[n].numel()
            full[n] = flat[offset:offset + size].view(full[n].shape).cpu()
            offset += size


def _merges(given: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether each dim of `given` is a run of consecutive `dims` (the IR keeps an input's dim as the
    several dims a reshape in the model cut it into)."""
    i = 0
    for size in given:
        product = 1
        while i < len(dims) and product < size:
            product *= dims[i]
            i += 1
        if product != size:
            return False
    return i == len(dims)
