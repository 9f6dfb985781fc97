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
`model.state_dict()` is this rank's shards under the IR's names (`layers.0.c_fc`),
`model.full_state_dict()` gathers the module's own state dict (a collective: call
it on every rank), `load_state_dict` takes either; `model.full_grads()` gathers the
gradients. With `zero=1|2|3` the parameters are this rank's flat ZeRO chunks
(`fivedc/parallel/weights.py`), so the optimizer's state is sharded too; with
pp > 1 a rank holds its pipeline chunks' parameters and `model(...)` runs the
whole schedule, its backward handing over the gradients the schedule computed
(`fivedc/parallel/pipeline.py`); the loop stays the same. `compile_module` does the
tracing and compiling alone, with no process group (for the CLI).
"""

from __future__ import annotations

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
from fivedc.plan.execution_plan import ExecutionPlan

_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ParallelizeOptions:
    mesh: Mesh
    example_inputs: object = None  # tuple/dict of tensors, or a callable(module) -> them
    sequence_parallel: bool | None = None
    shardings: Mapping[str, str] = field(default_factory=dict)
    zero: int = 0
    cp_attention: str | None = None
    cp_layout: str | None = None
    overlap: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual: int | None = None
    pp_layout: tuple[int, ...] | None = None
    recompute: str | None = None  # none | selective | full (fivedc/passes/recompute.py)
    stage_boundaries: tuple[str, ...] = ()  # module-path patterns where a pipeline chunk begins
    device: torch.device | str | None = None
    sync_module_states: bool = True
    auto: tuple[int, str] | None = None  # mesh="auto": (gpus, gpu) for the layout search (fivedc/search/search.py)
    compile: bool | str = False  # each repeat's layer one torch.compile region (fivedc/runtime/regions.py)


def parallelize(module: nn.Module | type | None = None, /, *, mesh: str | Mesh, example_inputs=None,
                sequence_parallel: bool | None = None, shardings: Mapping[str, str] | None = None, zero: int = 0,
                cp_attention: str | None = None, cp_layout: str | None = None, overlap: bool = True,
                bucket_mb: float = DEFAULT_BUCKET_MB, schedule: str = "1f1b", microbatches: int | None = None,
                virtual: int | None = None, pp_layout: tuple[int, ...] | None = None, recompute: str | None = None,
                stage_boundaries: tuple[str, ...] = (), device: torch.device | str | None = None, sync_module_states: bool = True,
                gpus: int | None = None, gpu: str | None = None, compile: bool | str = False):
    """Parallelize an `nn.Module` instance, or, as a decorator, an `nn.Module` class.

    mesh: "dp x pp x tp x cp x ep" (`"2x1x2x1x1"`) or `dp=2,tp=2`, or a `Mesh`.
    example_inputs: the forward's arguments to trace with (full global tensors).
    sequence_parallel: Megatron SP under tp. shardings: `{"module.path.*.pattern":
    "col" | "row" | "replicate"}`. cp_attention: "ring" | "allgather"; cp_layout:
    "balanced" | "contiguous". zero: 0-3, the ZeRO stage (the parameters become
    this rank's flat chunks; any torch optimizer over them keeps sharded state).
    overlap, bucket_mb: gradient buckets reduced during backward, and tp's backward
    sums run behind the weight gradients (`fivedc/runtime/tp_overlap.py`), tp's
    forward collectives beside their linears (`fivedc/runtime/tp_ring.py`). schedule
    ("gpipe" | "1f1b" | "interleaved" | "zb-h1" | "dualpipev"), microbatches,
    virtual, pp_layout (layers per chunk): the pipeline, when pp > 1; the forward
    then runs the whole schedule. recompute: activation recomputation, "none",
    "selective" (each attention recomputed in backward) or "full" (each layer keeps
    only its input). stage_boundaries: module-path patterns
    (`"layers.4"`) where a pipeline chunk begins, as do modules with
    `fivedc_stage_boundary = True`; the marks then decide the chunks. device: where the shards live (default: the current CUDA device with
    NCCL, else the module's). sync_module_states: start from rank 0's weights.
    mesh="auto": `fivedc search` picks the mesh and the plan options (the ones given here
    are then not used) for `gpus` GPUs (default: the job's world size) of kind `gpu` (h100, ...).
    compile: run each layer of a repeated block as one `torch.compile` region (compiled once
    for all the layers; collectives between ranks stay outside the compiled graphs); a string
    names torch.compile's backend (default "inductor").
    """
    auto = None
    if isinstance(mesh, str) and mesh == "auto":
        auto, mesh = _auto(gpus, gpu), Mesh((1, 1, 1, 1, 1))
    elif gpus is not None or gpu is not None:
        raise FivedcError("gpus= and gpu= are for mesh=\"auto\" (the layout search)",
                          hint="drop them, or pass mesh=\"auto\"")
    options = ParallelizeOptions(
        mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh), example_inputs, sequence_parallel,
        dict(shardings or {}), zero, cp_attention, cp_layout, overlap, bucket_mb, schedule, microbatches, virtual,
        tuple(pp_layout) if pp_layout is not None else None, recompute, tuple(stage_boundaries), device,
        sync_module_states, auto, compile,
    )
    if module is None:
        return lambda target: _apply(target, options)
    return _apply(module, options)


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
                  shardings: Mapping[str, str] | None = None,
                  stage_boundaries: tuple[str, ...] = ()) -> tuple[TracedModel, ExecutionPlan]:
    """Trace `module` and compile it at the fastest layout `fivedc search` finds on `gpus` x `gpu`."""
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import search

    traced = trace_module(module, example_inputs, stage_boundaries=stage_boundaries)
    result = search(pin_shardings(traced, shardings), gpus=gpus, hardware=hardware(gpu), dtype=module_dtype(module))
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
def _apply(target, options: ParallelizeOptions):
    if isinstance(target, type) and issubclass(target, nn.Module):
        return _decorate(target, options)
    if isinstance(target, nn.Module):
        return _build(target, options)
    raise FivedcError(f"parallelize takes an nn.Module instance or class, not {type(target).__name__}",
                      hint="fivedc.parallelize(model, mesh=...) or @fivedc.parallelize(mesh=...) on the class")


def _build(module: nn.Module, options: ParallelizeOptions):
    from fivedc.parallel.module import ParallelModule

    example = _example_inputs(module, options.example_inputs)
    if options.auto is not None:
        traced, plan = search_module(module, example, gpus=options.auto[0], gpu=options.auto[1],
                                     shardings=options.shardings, stage_boundaries=options.stage_boundaries)
        _check_world(plan.mesh)
        return ParallelModule(module, traced, plan, example_inputs=example, device=_device(module, options.device),
                              sync_module_states=options.sync_module_states, compile=options.compile)
    _check_world(options.mesh)
    traced, plan = compile_module(
        module, example, mesh=options.mesh, shardings=options.shardings, stage_boundaries=options.stage_boundaries,
        sequence_parallel=options.sequence_parallel, zero=options.zero, cp_attention=options.cp_attention,
        cp_layout=options.cp_layout, overlap=options.overlap, bucket_mb=options.bucket_mb,
        schedule=options.schedule, microbatches=options.microbatches, virtual=options.virtual,
        pp_layout=options.pp_layout, recompute=options.recompute,
    )
    return ParallelModule(module, traced, plan, example_inputs=example, device=_device(module, options.device),
                          sync_module_states=options.sync_module_states, compile=options.compile)


def _decorate(cls: type, options: ParallelizeOptions) -> type:
    """A subclass whose constructor builds a plain instance, then returns it parallelized.

    The plain instance is of the subclass, so the class's own `super(Name, self)`
    calls still work; `Name.fivedc_plain(...)` builds one without parallelizing."""
    meta = type(cls)

    class _Parallelized(meta):
        def __call__(self, *args, **kwargs):
            return _build(meta.__call__(self, *args, **kwargs), options)

    def fivedc_plain(klass, *args, **kwargs):
        return meta.__call__(klass, *args, **kwargs)

    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "__wrapped__": cls, "fivedc_options": options, "fivedc_plain": classmethod(fivedc_plain)}
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
