"""Equivalence of a parallelized module with the plain one, both trained by `torch.optim.AdamW`.

`train_module` runs the ordinary loop (`zero_grad`, `loss = model(*inputs)`,
`backward`, `step`) on either a plain module or a `ParallelModule` and records the
loss of every step, the gradients of every step and the parameters at the end, in
the original module's names (a parallel module's are gathered to full, so
comparing them checks every rank's shards). `check_module` trains the plain module
in this process, then the parallelized one on `mesh.world` workers (a
`WorkerPool`, or a temporary one), and reports the worst relative error of each
kind (relative to the largest magnitude of the reference tensor, as
`runtime/verify.py` does). The module comes from a `file.py:factory` spec, so
each worker builds it again; the reference's initial state is sent along, so the
factory need not be seeded.

Where the plain module has no float64 kernel for one of its ops (Hugging Face's
grouped experts call `torch.nn.functional.grouped_mm`, which on CPU takes float32
and 16-bit floats only), a float64 check cannot run its reference: both runs then
fall back to float32, and the report says so (`ModuleCheck.dtype`, `note`), so
that `fivedc verify` judges it with float32's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from fivedc.errors import FivedcError
from fivedc.frontends.fx.params import module_state
from fivedc.frontends.fx.flex import flex_attention_on_cpu
from fivedc.frontends.fx.precision import float64_everywhere, without_dropout
from fivedc.runtime.states import after_step_hooks
from fivedc.runtime.compare import check_reference, compare_runs, compare_states

_DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype)`, with its complex tensors made complex of that precision: `nn.Module.to`
    casts a complex buffer to the real dtype, dropping its imaginary part (torchtitan's ComplexRoPE
    keeps its rotary table as one)."""
    return module._apply(lambda t: t.to(_COMPLEX[dtype]) if t.is_complex() else
                         t.to(dtype) if t.is_floating_point() else t)


@dataclass
class ModuleRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)  # per step, the module's parameter names
    params: dict[str, Tensor] = field(default_factory=dict)  # after the last step
    buffers: dict[str, Tensor] = field(default_factory=dict)  # after the last step: the states (plain: every buffer)
    changed: tuple[str, ...] = ()  # (plain) the buffers training changed


@dataclass(frozen=True)
class ModuleCheck:
    """The fields `fivedc verify` prints, as for a DSL model's `VerifyReport`."""

    losses: tuple[float, ...]  # the plain module's, per step
    parallel_losses: tuple[float, ...]
    loss_error: float
    grad_error: float
    param_error: float
    worst: str
    state_error: float = 0.0  # the buffers the forward writes and the after-step hooks update
    world: int = 1
    expert_load: tuple = ()  # (MoE routing statistics: none for a dense module)
    dtype: str | None = None  # the precision both runs took ("fp32" where float64 had no kernel)
    note: str = ""  # why the precision is not the one asked for
    module: bool = True  # checked against the plain module (a plan's report is against the plan on one device)
    traced: bool = False  # verify traced the module's plan op by op (fivedc/cli/verify.py)
    divergence: object = None  # then its first divergent op (runtime/divergence.Divergence), or None
    injected: int = 0

    @property
    def max_error(self) -> float:
        traced = self.divergence.error if self.divergence is not None else 0.0
        return max(self.loss_error, self.grad_error, self.param_error, self.state_error, traced)


def train_module(model: nn.Module, inputs: tuple | dict, *, steps: int = 2, lr: float = 1e-2,
                 weight_decay: float = 0.1, autocast: str | None = None, on_step=None) -> ModuleRun:
    """autocast ("bf16", "fp16"): each forward under `torch.autocast` in that dtype, the parameters
    (master weights) in theirs (runtime/precision.py)."""
    from fivedc.parallel.module import ParallelModule

    parallel = isinstance(model, ParallelModule)
    hooks = () if parallel else after_step_hooks(model, None)
    start = {} if parallel else {k: b.detach().clone() for k, b in model.named_buffers()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    device = next(model.parameters()).device.type
    run = ModuleRun()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=AUTOCAST_DTYPES[autocast or "bf16"], enabled=autocast is not None):
            loss = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss.backward()
        run.losses.append(loss.item())
        grads = model.full_grads() if parallel else {n: p.grad for n, p in model.named_parameters()}
        run.grads.append({n: g.detach().clone().cpu() for n, g in grads.items()})
        opt.step()
        _after_step(model, parallel, hooks)
        if on_step is not None:
            on_step(len(run.losses), run.losses[-1])
    state = model.full_state_dict() if parallel else module_state(model)
    names = {m.key for m in model.fivedc_traced.params} if parallel else dict(model.named_parameters())
    run.params = {k: v.detach().clone().cpu() for k, v in state.items() if k in names}
    if parallel:
        run.buffers = {**{k: v.detach().clone().cpu() for k, v in state.items() if k not in names},
                       **model.full_states()}
    else:
        run.buffers = {k: b.detach().clone().cpu() for k, b in model.named_buffers()}
        run.changed = tuple(k for k, b in run.buffers.items() if k in start and not torch.equal(b, start[k].cpu()))
    return run


def _after_step(model: nn.Module, parallel: bool, hooks: tuple) -> None:
    """What the training loop does after the optimizer's step: the parallel module's `after_step`
    (its states summed over pp, its hooks), or the plain module's hooks on it."""
    if parallel:
        model.after_step()
        return
    with torch.no_grad():
        for hook in hooks:
            hook(model)


def rank_job(info, payload) -> ModuleRun | None:
    """One rank: build the module from its spec, load the reference's start, parallelize, train."""
    steps = payload[-1]["steps"]
    run = _parallel_run(payload, info.device, lambda step, loss: info.report(f"step {step}/{steps}: loss {loss:.6g}"))
    return run if info.rank == 0 else None


def _parallel_run(payload, device, on_step=None, *, keep=None) -> ModuleRun:
    from fivedc.frontends.python_file import load_factory
    from fivedc.parallel.parallelize import parallelize

    spec, kwargs, dtype, state, inputs, options, settings = payload
    module, _ = load_factory(spec, kwargs=kwargs)
    if dtype is not None:
        module = in_dtype(module, _DTYPES[dtype])
    module.load_state_dict(state)
    model = parallelize(module, example_inputs=inputs, device=device, **options)
    if keep is not None:
        keep(model)
    return train_module(model, inputs, **settings, on_step=on_step)


def check_module_here(spec: str, *, kwargs: dict | None = None, steps: int = 2, lr: float = 1e-2,
                      weight_decay: float = 0.1, dtype: str | None = None, meshes=()) -> ModuleCheck:
    """`check_module` on one rank (mesh 1x1x1x1x1), in this process: no worker, no process group.
    What the tests run on every library model (tests/library_models.py): the plain module against
    `parallelize(module, mesh="1x1x1x1x1")`, both trained here; its traced graph is also compiled
    for each of `meshes` (agreement proof included: a refusal raises), without tracing it again."""
    import torch.distributed as dist

    from fivedc.frontends.python_file import load_factory

    if dist.is_initialized():
        raise FivedcError("check_module_here runs one rank without a process group, but one is initialized",
                          hint="inside a torch.distributed job call check_module (every rank)")
    module, inputs = load_factory(spec, kwargs=kwargs)
    settings = {"steps": steps, "lr": lr, "weight_decay": weight_decay, "autocast": None}
    dtype, state, inputs, reference, note = _reference(spec, module, inputs, dtype, settings)
    models = []
    parallel = _parallel_run((spec, kwargs, dtype, state, inputs, {"mesh": "1x1x1x1x1"}, settings), "cpu",
                             keep=models.append)
    if meshes:
        from fivedc.ir.mesh import Mesh
        from fivedc.passes.base import CompileOptions
        from fivedc.pipeline import compile_graph

        for mesh in meshes:
            compile_graph(models[0].fivedc_traced.graph,
                          CompileOptions(mesh=mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh), dtype=dtype or "fp64"))
    return replace(compare(reference, parallel), world=1, dtype=dtype, note=note)


def check_module(spec: str, *, mesh, kwargs: dict | None = None, steps: int = 2, lr: float = 1e-2,
                 weight_decay: float = 0.1, dtype: str | None = None, seed: int | None = None, pool=None,
                 timeout_s: float | None = None, on_progress=None, autocast: str | None = None,
                 **options) -> ModuleCheck | None:
    """Train the plain module here and `parallelize(module, mesh=mesh, **options)` on `mesh.world`
    processes (mesh: a `Mesh` or its text), and compare. dtype ("fp64", "fp32"): cast the module
    (default: as built); autocast ("bf16", "fp16"): both runs' forwards under `torch.autocast`
    (mixed precision: compare with a 16-bit tolerance); seed: `torch.manual_seed` before the factory runs. Inside a torch.distributed job (torchrun) this
    process is one rank: every rank must call it, and rank 0 gets the result, the others None."""
    import torch.distributed as dist

    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.runtime.pool import DEFAULT_TIMEOUT_S, RankInfo, run_once

    if seed is not None:
        torch.manual_seed(seed)
    module, inputs = load_factory(spec, kwargs=kwargs)
    if not any(p.requires_grad for p in module.parameters()):
        raise FivedcError(f"{spec} builds a module with no trainable parameters: there is nothing to verify",
                          hint="return the model that holds the weights from the factory")
    settings = {"steps": steps, "lr": lr, "weight_decay": weight_decay, "autocast": autocast}
    dtype, state, inputs, reference, note = _reference(spec, module, inputs, dtype, settings)
    payload = (spec, kwargs, dtype, state, inputs, {"mesh": mesh, **options}, settings)
    world = (mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)).world
    if dist.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        parallel = rank_job(RankInfo(dist.get_rank(), dist.get_world_size(), device), payload)
        return replace(compare(reference, parallel), world=world, dtype=dtype, note=note) \
            if parallel is not None else None
    if on_progress is not None:
        on_progress(f"reference run of the plain module: {steps} steps")
    if pool is not None:
        parallel = pool.run(rank_job, world=world, payload=payload, on_progress=on_progress)[0]
    else:
        parallel = run_once(rank_job, world=world, payload=payload, timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
                            on_progress=on_progress)[0]
    return replace(compare(reference, parallel), world=world, dtype=dtype, note=note)


def _reference(spec: str, module: nn.Module, inputs, dtype: str | None, settings: dict):
    """(dtype, initial state, inputs, the plain module's run, note): in `dtype`, or in float32 where
    the module has no float64 kernel for some op (then the note says which error it met)."""
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    note = ""
    for attempt in (dtype, "fp32") if dtype == "fp64" else (dtype,):
        model = in_dtype(module, _DTYPES[attempt]) if attempt is not None else module
        if attempt != dtype:
            model.load_state_dict({k: v.to(_DTYPES[attempt]) if v.is_floating_point() else v for k, v in start.items()})
        cast = _cast(inputs, _DTYPES[attempt]) if attempt is not None else inputs
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        try:
            with float64_everywhere(attempt == "fp64"), without_dropout(), flex_attention_on_cpu(eager=True):
                # as the plan computes: fivedc/frontends/fx/precision.py; flex attention by torch's eager op: flex.py
                reference = train_module(model, cast, **settings)
        except (RuntimeError, NotImplementedError) as error:
            if attempt != "fp64":
                raise
            note = (f"the plain module has no float64 kernel for one of its ops ({type(error).__name__}: "
                    f"{str(error).splitlines()[0][:120]}): both runs are in float32")
            continue
        check_reference(reference.losses, [*reference.grads, reference.params], what=spec)
        return attempt, state, cast, reference, note
    raise AssertionError("unreachable: the float32 attempt returns or raises")


def compare(reference: ModuleRun, parallel: ModuleRun) -> ModuleCheck:
    """The worst relative error of each kind (runtime/compare.py: a missing step or
    tensor, or a non-finite value in the parallel run, is an infinite error)."""
    worst = compare_runs(parallel, reference, names=tuple(reference.params))
    keys = dict.fromkeys((*reference.changed, *(k for k in parallel.buffers if k in reference.buffers
                                                 and reference.buffers[k].is_floating_point())))
    worst["state"] = compare_states(parallel.buffers, reference.buffers, keys)
    return ModuleCheck(tuple(reference.losses), tuple(parallel.losses), worst["loss"][0], worst["grad"][0],
                       worst["param"][0], max(worst.values())[1], state_error=worst["state"][0])


def _cast(inputs, dtype: torch.dtype):
    """Floating-point example inputs in `dtype` (token ids stay integers)."""
    def cast(x):
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    return {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(cast(x) for x in inputs)
