"""`fivedc.parallelize`: an ordinary `nn.Module` trained with a fivedc plan.

On an instance, inside a torch.distributed job (torchrun, then
`fivedc.runtime.pool.init_from_env()` or `dist.init_process_group`)::

    model = fivedc.parallelize(GPT(config), mesh="2x1x2x1x1", example_inputs=(idx, targets))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for idx, targets in batches:          # FULL global batches, the same on every rank
        loss = model(idx, targets)        # the full loss, on every rank
        loss.backward()                   # gradients summed over dp/cp/... when this returns
        opt.step(); opt.zero_grad()

or on the class, whose constructor then returns the parallel module::

    @fivedc.parallelize(mesh="2x1x2x1x1", shardings={"transformer.h.*.mlp.*": "replicate"})
    class GPT(nn.Module):
        def example_inputs(self):          # or parallelize(..., example_inputs=...)
            return idx, targets
        ...
    model = GPT(config)                    # a ParallelModule; GPT.fivedc_plain(config) is the plain one

The module is traced (`fivedc.frontends.fx_module.trace_module`) on example inputs
(`example_inputs=`: a tuple or dict of tensors, or a callable taking the built
module; else the module's own `example_inputs()` method), its shardings are
pinned by module-path pattern (`fivedc/parallel/pins.py`), the graph is compiled
by the same pipeline as a DSL model, and every rank keeps only its shards
(`fivedc/parallel/module.py`). The plan's dtype is the module's parameter dtype.
Shapes are static: the plan is for the example inputs' shapes (and non-tensor
arguments keep their example values; a call with others is an error). The result:
`model.fivedc_plan` (an `ExecutionPlan`: `.save()`, `fivedc diff`);
`model.named_parameters()` and `model.state_dict()` keep the module's names, each
tensor this rank's block of the module's (`fivedc/parallel/names.py`),
`model.full_state_dict()` gathers the module's own state dict (a collective: call
it on every rank), `load_state_dict` takes either; `model.full_grads()` gathers the
gradients. With `zero=1|2|3` the parameters are this rank's flat ZeRO chunks, still
under the module's names (`fivedc/parallel/weights.py`), so the optimizer's state is
sharded too; with pp > 1 a rank holds its pipeline chunks' parameters and
`model(...)` runs the whole schedule, its backward handing over the gradients the
schedule computed (`fivedc/parallel/pipeline.py`); the loop stays the same.
`compile_module` does the tracing and compiling alone, with no process group (for
the CLI).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fivedc.errors import FivedcError, MeshError, NotSupportedError
from fivedc.frontends.fx_module import TracedModel, trace_module
from fivedc.ir.mesh import Mesh
from fivedc.parallel.pins import pin_shardings
from fivedc.passes.base import DEFAULT_BUCKET_MB, CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.states import after_step_hooks
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.schedule import DEFAULT_SCHEDULE

_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ParallelizeOptions:
    """The keyword options of `fivedc.parallelize` besides mesh and example_inputs, with their defaults."""

    sequence_parallel: bool | None = None  # Megatron SP under tp (None: the model's choice)
    shardings: Mapping[str, str] = field(default_factory=dict)  # {"module.path.*": "col" | "row" | "replicate"}
    zero: int = 0  # ZeRO stage 0-3
    cp_attention: str | None = None  # "ring" | "allgather"
    cp_layout: str | None = None  # "balanced" | "contiguous"
    overlap: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    schedule: str = DEFAULT_SCHEDULE
    microbatches: int | None = None
    virtual: int | None = None
    pp_layout: tuple[int, ...] | None = None
    recompute: str | None = None  # none | selective | full (passes/recompute.py)
    fp8: bool = False  # linears in float8, torchao's tensorwise recipe (passes/fp8.py); also under mesh="auto"
    stage_boundaries: tuple[str, ...] = ()  # module-path patterns where a pipeline chunk begins
    device: torch.device | str | None = None
    sync_module_states: bool = True
    compile: bool | str = False  # each repeat's layer one torch.compile region (runtime/regions.py)
    gpus: int | None = None  # mesh="auto": GPUs the layout search plans for (default: the job's world size)
    gpu: str | None = None  # mesh="auto": their kind (h100, ...)
    after_step: object = None  # fn(model) or a tuple of them, run by model.after_step() (None: the module's own)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shardings", dict(self.shardings or {}))
        object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
        if self.pp_layout is not None:
            object.__setattr__(self, "pp_layout", tuple(self.pp_layout))


@dataclass(frozen=True)
class _Request:
    """What one `parallelize` call asks for: the mesh (or the search's GPUs), the example inputs, the options."""

    mesh: Mesh
    example_inputs: object  # tuple/dict of tensors, or a callable(module) -> them
    auto: tuple[int, str] | None  # mesh="auto": (gpus, gpu) for the layout search (fivedc/search/search.py)
    options: ParallelizeOptions


def parallelize(module: nn.Module | type | None = None, /, *, mesh: str | Mesh, example_inputs=None, **options):
    """Parallelize an `nn.Module` instance (returned) or, as a decorator, an `nn.Module` class.

    Before calling it with a mesh of more than one rank, start the processes with torchrun
    (`torchrun --nproc-per-node N train.py`) and create the process group
    (`fivedc.runtime.pool.init_from_env()` or `torch.distributed.init_process_group`): the
    mesh's world must be the job's. The module's `forward` must return the loss, a scalar
    (e.g. `F.cross_entropy(logits, targets)`), for the whole batch it is given.

    The result is called like the module, on every rank with the same FULL global batch,
    and returns the full loss; `loss.backward()` leaves each parameter's gradient summed
    over the ranks, so any torch optimizer over `model.parameters()` trains it::

        model = fivedc.parallelize(GPT(config), mesh="2x1x2x1x1", example_inputs=(idx, targets))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        loss = model(idx, targets); loss.backward(); opt.step(); opt.zero_grad()

    mesh: "DPxPPxTPxCPxEP" (`"2x1x2x1x1"`), `"dp=2,tp=2"`, a `Mesh`, or "auto": `fivedc
    search` picks the layout for gpus= GPUs of kind gpu= (the plan options below are then
    not used, but fp8). example_inputs: the forward's arguments to trace with (full global tensors,
    a tuple or dict, or a function of the module; default: the module's `example_inputs()`);
    the plan is for their shapes.

    options (keywords, the fields of `ParallelizeOptions`): sequence_parallel (Megatron SP
    under tp); shardings `{"module.path.*": "col" | "row" | "replicate"}`; zero 0-3 (the
    parameters become this rank's flat chunks); cp_attention "ring" | "allgather";
    cp_layout "balanced" | "contiguous"; overlap, bucket_mb (gradient buckets summed during
    backward, tp's collectives beside compute); schedule (a name of
    `fivedc.schedule.SCHEDULES`: gpipe, 1f1b, interleaved, zb-h1, dualpipev, dualpipe), microbatches, virtual, pp_layout (layers per chunk),
    stage_boundaries (module-path patterns where a pipeline chunk begins, as at modules with
    `fivedc_stage_boundary = True`): the pipeline when pp > 1, the forward then running the
    whole schedule; recompute "none" | "selective" | "full"; fp8 (the linears' three matmuls in
    float8 as torchao's tensorwise recipe runs them, `fivedc compile --fp8`: e4m3 inputs and
    weights, e5m2 output gradients, dynamic scales, each data-parallel rank's rows scaled on
    their own; emulated at the module's dtype, not the output head); device (default: the current
    CUDA device with NCCL, else the module's); sync_module_states (start from rank 0's
    weights, default True); compile (each layer of a repeated block one `torch.compile`
    region; a string names the backend); after_step (a function fn(model), or a tuple of them:
    updates the training loop makes after each optimizer step from the buffers the forward
    writes, as torchtitan's trainer updates its MoE expert bias from the tokens per expert;
    call `model.after_step()` after `optimizer.step()` to run them; default: the module's
    `fivedc_after_step` attribute).

    `model.fivedc_plan` is the plan. `model.named_parameters()` and `model.state_dict()` keep
    the module's names (`layers.0.attn.q_proj.weight`; a tied weight once, under its first
    name, as torch gives it), each tensor this rank's block of the module's in the module's
    layout (a column-parallel linear's rows, a row-parallel one's columns, a fused qkv
    weight's q, k and v rows of this rank; this rank's experts; under ZeRO a flat chunk), so
    param groups by name, saving and loading work as on the module. `model.full_state_dict()`
    gathers the module's own state dict, its names and shapes (call it on every rank). On a
    class, the constructor returns the parallel module and `Class.fivedc_plain(...)` the
    plain one.
    """
    request = _request(mesh, example_inputs, _options(options))
    if module is None:
        return lambda target: _apply(target, request)
    return _apply(module, request)


def _options(given: dict) -> ParallelizeOptions:
    """The keywords as `ParallelizeOptions`; an unknown one is an error naming the closest."""
    import difflib

    names = [f.name for f in dataclasses.fields(ParallelizeOptions)]
    for name in given:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            raise FivedcError(f"parallelize has no option {name}=",
                              hint=f"did you mean {close[0]}=?" if close else f"the options: {', '.join(names)}")
    return ParallelizeOptions(**given)


def _request(mesh: str | Mesh, example_inputs, options: ParallelizeOptions) -> _Request:
    if isinstance(mesh, str) and mesh == "auto":
        return _Request(Mesh((1, 1, 1, 1, 1)), example_inputs, _auto(options.gpus, options.gpu), options)
    if options.gpus is not None or options.gpu is not None:
        raise FivedcError("gpus= and gpu= are for mesh=\"auto\" (the layout search)",
                          hint="drop them, or pass mesh=\"auto\"")
    return _Request(mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh), example_inputs, None, options)


def compile_module(module: nn.Module, example_inputs, *, mesh: Mesh | None = None,
                   options: CompileOptions | None = None, shardings: Mapping[str, str] | None = None,
                   stage_boundaries: tuple[str, ...] = (), **fields) -> tuple[TracedModel, ExecutionPlan]:
    """Trace `module` on `example_inputs` (pipeline chunks beginning at `stage_boundaries`),
    pin `shardings`, compile: no process group needed.

    Give `options` (a `CompileOptions`, as the CLI builds), or `mesh` and any other
    `CompileOptions` fields as keywords (sequence_parallel, zero, ...; dtype defaults
    to the module's parameter dtype)."""
    if options is None:
        if mesh is None:
            raise FivedcError("compile_module needs a mesh (or CompileOptions)")
        fields.setdefault("dtype", module_dtype(module))
        options = CompileOptions(mesh=mesh, **fields)
    traced = trace_module(module, example_inputs, stage_boundaries=stage_boundaries)
    return traced, compile_graph(pin_shardings(traced, shardings), options)


def search_module(module: nn.Module, example_inputs, *, gpus: int, gpu: str,
                  shardings: Mapping[str, str] | None = None, stage_boundaries: tuple[str, ...] = (),
                  fp8: bool = False) -> tuple[TracedModel, ExecutionPlan]:
    """Trace `module` and compile it at the fastest layout `fivedc search` finds on `gpus` x `gpu`
    (with float8 linears on every layout under `fp8`, as `fivedc search --fp8`)."""
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import search

    traced = trace_module(module, example_inputs, stage_boundaries=stage_boundaries)
    result = search(pin_shardings(traced, shardings), gpus=gpus, hardware=hardware(gpu), dtype=module_dtype(module),
                    fp8=fp8)
    return traced, result.plan


def _auto(gpus: int | None, gpu: str | None) -> tuple[int, str]:
    if gpu is None:
        raise FivedcError("mesh=\"auto\" needs gpu= (h100, h800, a100, h200): the search scores layouts on it",
                          hint="e.g. fivedc.parallelize(model, mesh=\"auto\", gpus=8, gpu=\"h100\")")
    if gpus is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise FivedcError("mesh=\"auto\" needs gpus= outside a torch.distributed job", hint="e.g. gpus=8")
        gpus = dist.get_world_size()
    return gpus, gpu


def module_dtype(module: nn.Module) -> str:
    """The plan dtype of a module: that of its first floating-point parameter."""
    for p in module.parameters():
        if p.is_floating_point():
            if p.dtype not in _DTYPES:
                raise NotSupportedError(f"parameters of dtype {p.dtype} are not supported",
                                        hint=f"use one of {', '.join(map(str, _DTYPES))}")
            return _DTYPES[p.dtype]
    return "fp32"


# ---- instance and class ---------------------------------------------------------------
def _apply(target, request: _Request):
    if isinstance(target, type) and issubclass(target, nn.Module):
        return _decorate(target, request)
    if isinstance(target, nn.Module):
        return _build(target, request)
    raise FivedcError(f"parallelize takes an nn.Module instance or class, not {type(target).__name__}",
                      hint="fivedc.parallelize(model, mesh=...) or @fivedc.parallelize(mesh=...) on the class")


def _build(module: nn.Module, request: _Request):
    from fivedc.parallel.module import ParallelModule

    options = request.options
    example = _example_inputs(module, request.example_inputs)
    if request.auto is not None:
        traced, plan = search_module(module, example, gpus=request.auto[0], gpu=request.auto[1],
                                     shardings=options.shardings, stage_boundaries=options.stage_boundaries,
                                     fp8=options.fp8)
        _check_world(plan.mesh)
    else:
        _check_world(request.mesh)
        traced, plan = compile_module(
            module, example, mesh=request.mesh, shardings=options.shardings,
            stage_boundaries=options.stage_boundaries, sequence_parallel=options.sequence_parallel,
            zero=options.zero, cp_attention=options.cp_attention, cp_layout=options.cp_layout,
            overlap=options.overlap, bucket_mb=options.bucket_mb, schedule=options.schedule,
            microbatches=options.microbatches, virtual=options.virtual, pp_layout=options.pp_layout,
            recompute=options.recompute, fp8=options.fp8,
        )
    return ParallelModule(module, traced, plan, example_inputs=example, device=_device(module, options.device),
                          sync_module_states=options.sync_module_states, compile=options.compile,
                          after_step=after_step_hooks(module, options.after_step))



def _decorate(cls: type, request: _Request) -> type:
    """A subclass whose constructor builds a plain instance, then returns it parallelized.

    The plain instance is of the subclass, so the class's own `super(Name, self)`
    calls still work; `Name.fivedc_plain(...)` builds one without parallelizing."""
    meta = type(cls)

    class _Parallelized(meta):
        def __call__(self, *args, **kwargs):
            return _build(meta.__call__(self, *args, **kwargs), request)

    def fivedc_plain(klass, *args, **kwargs):
        return meta.__call__(klass, *args, **kwargs)

    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "__wrapped__": cls, "fivedc_options": request.options, "fivedc_plain": classmethod(fivedc_plain)}
    return _Parallelized(cls.__name__, (cls,), namespace)


def _example_inputs(module: nn.Module, given):
    source = given if given is not None else getattr(module, "example_inputs", None)
    if callable(source) and not isinstance(source, torch.Tensor):
        try:
            source = source(module) if given is not None else source()
        except FivedcError:
            raise
        except Exception as error:
            from fivedc.frontends.fx.locs import error_loc

            raise FivedcError(f"making the example inputs of {type(module).__name__} failed: "
                              f"{type(error).__name__}: {error}", loc=error_loc(error)) from None
    if isinstance(source, torch.Tensor):
        source = (source,)
    if not isinstance(source, (tuple, list, dict)):
        name = type(module).__name__
        got = f", got {type(source).__name__}" if source is not None else ""
        raise FivedcError(
            f"parallelize needs example inputs to trace {name}{got}",
            hint=f"pass example_inputs=(inputs, targets) (or a function of the module), or define "
            f"{name}.example_inputs(self) returning them: full global tensors of the training shapes",
        )
    return dict(source) if isinstance(source, dict) else tuple(source)


def _check_world(mesh: Mesh) -> None:
    if not dist.is_initialized():
        if mesh.world > 1:
            raise MeshError(
                f"the mesh {mesh} needs a torch.distributed job of {mesh.world} processes, "
                "but no process group is initialised",
                hint=f"start with torchrun --nproc-per-node={mesh.world} and call "
                "fivedc.runtime.pool.init_from_env() (or dist.init_process_group) before parallelize",
            )
        return
    if dist.get_world_size() != mesh.world:
        raise MeshError(
            f"the mesh {mesh} needs {mesh.world} processes but the process group has {dist.get_world_size()}",
            hint=f"start {mesh.world} processes, or choose a mesh whose sizes multiply to {dist.get_world_size()}",
        )


def _device(module: nn.Module, given) -> torch.device:
    if given is not None:
        return torch.device(given)
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


__all__ = ["parallelize", "compile_module", "ParallelizeOptions", "module_dtype"]
