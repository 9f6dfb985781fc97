"""What the commands share: models and plans loaded, plan options read, local runs checked.

`fivedc/cli/main.py` parses the command line and dispatches; `verify.py` and
`run.py` run the two commands that start processes. All three take from here:
`load_graph` (a `.5d` model or `file.py:factory`), `compile_model` (a model and a
mesh with the command line's options), `load_plan_or_compile`, `compile_options`
(the command line's plan options as `CompileOptions`), `check_local_run` and
`progress_printer`. Nothing here imports the commands, so none imports another.
"""

from __future__ import annotations

import dataclasses
import math
import time

from fivedc.errors import FivedcError


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600.0  # a collective waits at least a second, at most a week


def check_local_run(args) -> None:
    if not (math.isfinite(args.timeout) and MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S):
        raise FivedcError(f"--timeout {args.timeout:g} must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds "
                          "(how long a rank waits in one collective)", hint="e.g. --timeout 600")


def progress_printer():
    """Print progress lines with the seconds since the command started (verify, run)."""
    start = time.perf_counter()
    from fivedc.cli.screen import say

    return lambda line: say(f"  [{time.perf_counter() - start:6.1f} s] {line}", indent=" " * 13, flush=True)


def compile_options(args, mesh, *, dtype: str, pipeline_flags_need_pp: bool = True):
    """CompileOptions from the command line's mesh and plan options. Pipeline flags on a
    mesh with pp = 1 are an error (they would change nothing), unless the same flags
    serve meshes with and without a pipeline (`fivedc diff`)."""
    from fivedc.ir.mesh import MeshAxis
    from fivedc.passes.base import CompileOptions
    from fivedc.schedule import DEFAULT_SCHEDULE

    options = CompileOptions(
        mesh=mesh, sequence_parallel=args.sp, dtype=dtype,
        cp_attention=args.cp_attention, cp_layout=args.cp_layout, zero=args.zero,
        attention_kernel=args.attention_kernel,
        overlap=args.overlap, bucket_mb=args.bucket_mb, schedule=args.schedule or DEFAULT_SCHEDULE,
        microbatches=args.microbatches, virtual=args.virtual, pp_layout=_layout(args.pp_layout),
        recompute=args.recompute, hardware=_hardware(args), fp8=getattr(args, "fp8", False),
    )  # checks each value first
    given = [f"--{name.replace('_', '-')}" for name in ("schedule", "microbatches", "virtual", "pp_layout")
             if getattr(args, name) is not None]
    if pipeline_flags_need_pp and given and mesh.size(MeshAxis.PP) == 1:
        raise FivedcError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} up a pipeline, but mesh {mesh} has "
                          "pp=1: there is none, and the flag would change nothing",
                          hint="drop the flag, or give the mesh a pipeline axis, e.g. --mesh 1x2x1x1x1")
    return options


def _hardware(args):
    """The GPU profile `--gpu` names (from fivedc/ir/hardware.toml and any `--hardware` files)."""
    if getattr(args, "gpu", None) is None:
        if getattr(args, "hardware", None):
            raise FivedcError("--hardware adds GPU profiles, but no --gpu says which to use", hint="add --gpu NAME")
        return None
    from fivedc.ir.hardware import hardware

    return hardware(args.gpu, tuple(args.hardware or ()))


def _layout(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise FivedcError(f"--pp-layout {text!r} is not a list of layer counts", hint="e.g. --pp-layout 3,5,5,3") from None


def load_graph(model: str, stage_boundaries: list[str] | tuple[str, ...] = (), *, weights: bool = True):
    """A `.5d` model, or `path/to/file.py:factory` traced with torch.fx (with pipeline
    chunks beginning at the modules `stage_boundaries` match; `weights=False`: built without
    allocating its parameters, `fivedc/frontends/weightless.py`)."""
    from fivedc.frontends.python_file import graph_from_spec, is_spec

    if model.endswith(".json"):
        raise FivedcError(f"{model} is a plan file, and this command takes a model",
                          hint="compile the model it came from (.5d or file.py:factory); "
                          "a plan runs with fivedc run PLAN.json and checks with fivedc check PLAN.json")
    from fivedc.cli.model_source import stamp

    if is_spec(model):
        from fivedc.frontends.python_file import parse_spec

        graph = graph_from_spec(model, stage_boundaries=tuple(stage_boundaries), weights=weights)
        return stamp(graph, parse_spec(model)[0])
    check_no_stage_boundaries(model, stage_boundaries)
    if not weights:
        raise FivedcError(f"--no-weights builds a file.py:factory model without its parameters; {model} is a DSL "
                          "model, which never allocates any at compile", hint="leave --no-weights out")
    from fivedc.frontends.dsl_file import load_model

    return stamp(load_model(model), model)


def with_shape(graph, *, batch: int | None, seq: int | None):
    """The model at another global batch or sequence length (its batch and sequence dims):
    `--global-batch` and `--seq` of `fivedc compile` and `fivedc search`."""
    from fivedc.ir.limits import MAX_DIM

    changes = {}
    for what, dim, value in (("--global-batch", graph.batch_dim, batch), ("--seq", graph.seq_dim, seq)):
        if value is None:
            continue
        if value < 1:
            raise FivedcError(f"{what} {value} must be at least 1")
        if value > MAX_DIM:
            raise FivedcError(f"{what} {value} is larger than fivedc plans for (at most 2^31 = {MAX_DIM})",
                              hint=f"{what} counts {'sequences' if what == '--global-batch' else 'tokens'}; "
                              "give a real size, e.g. 1024")
        if dim is None:
            kind = "batch" if what == "--global-batch" else "sequence"
            raise FivedcError(f"{what}: the model {graph.name} has no {kind} dim", hint=f"drop {what}")
        changes[dim] = value
    if not changes:
        return graph
    return dataclasses.replace(graph, dims=tuple((k, changes.get(k, v)) for k, v in graph.dims))


def with_layers(graph, layers: int | None):
    """The model with at most `layers` layers in each repeat (`fivedc rehearse --layers`: a
    stage too large for one device, rehearsed at its per-layer shapes with fewer layers)."""
    from fivedc.ir.graph import Repeat

    if layers is None:
        return graph
    if layers < 1:
        raise FivedcError(f"--layers {layers} must be at least 1", hint="the layers each repeat keeps, e.g. --layers 2")
    items = []
    for item in graph.body.items:
        if isinstance(item, Repeat) and item.count > layers:
            if any(k >= layers for k in item.stage_layers):
                raise FivedcError(f"--layers {layers}: repeat {item.name} marks a pipeline chunk at layer "
                                  f"{max(item.stage_layers)}, which fewer layers would drop",
                                  hint=f"give --layers {max(item.stage_layers) + 1} or more")
            item = dataclasses.replace(item, count=layers)
        items.append(item)
    return dataclasses.replace(graph, body=dataclasses.replace(graph.body, items=tuple(items)))


def check_no_stage_boundaries(model: str, stage_boundaries) -> None:
    if stage_boundaries:
        raise FivedcError(
            f"--stage-boundary marks modules of a traced file.py:factory model; {model} is a DSL model",
            hint="mark the DSL instead: `repeat layers @stage(4) { ... }` begins a chunk at layer 4, "
            "`@stage` after a top-level statement begins one there",
        )


def compile_model(model: str, mesh_text: str, args, *, dtype: str, pipeline_flags_need_pp: bool = True,
                  proofs: list | None = None, timings: list | None = None):
    from fivedc.ir.mesh import Mesh
    from fivedc.pipeline import compile_graph

    mesh = Mesh.parse(mesh_text, rank_order=args.rank_order)
    options = compile_options(args, mesh, dtype=dtype, pipeline_flags_need_pp=pipeline_flags_need_pp)
    graph = load_graph(model, args.stage_boundary, weights=getattr(args, "weights", True))
    graph = with_shape(graph, batch=getattr(args, "global_batch", None), seq=getattr(args, "seq", None))
    graph = with_layers(graph, getattr(args, "layers", None))
    return compile_graph(graph, options, proofs=proofs, timings=timings)


def load_plan_or_compile(model: str, args, *, dtype: str):
    """A saved plan (.json), or the model compiled with the command line's mesh and options."""
    from fivedc.cli.plan_check import load_plan

    if model.endswith(".json"):
        return load_plan(model)
    return compile_model(model, args.mesh, args, dtype=dtype)


def executed_plan(args, defaults, *, verb: str, dtype: str, say=print):
    """The plan `fivedc run` or `fivedc rehearse` executes: a saved plan (.json: no flag that
    would change it; its model checked against its source file, said by `say`) or the model
    compiled with the command line's mesh and options. The --report target is checked before
    any work. `verb`: "running", "rehearsing" (for the messages)."""
    saved = args.model.endswith(".json")
    if saved:
        given = plan_flags_given(args, defaults)
        if given:
            raise FivedcError(f"{args.model} is a compiled plan: its mesh and options are fixed, and "
                              f"{', '.join(given)} would change them",
                              hint="drop them, or give the model file (.5d or file.py:factory) with the new options")
    elif args.mesh is None:
        raise FivedcError(f"{verb} {args.model} needs a mesh", hint="add --mesh DPxPPxTPxCPxEP, e.g. --mesh 2x1x2x1x1")
    if args.report is not None:  # refuse a bad target before anything runs
        from fivedc.files import check_output

        check_output(args.report, inputs=(args.model.split(":")[0],))
    plan = load_plan_or_compile(args.model, args, dtype=dtype)
    if saved:
        from fivedc.cli.model_source import check_source

        say(check_source(plan, plan_name=args.model, source=args.source))
    elif args.source is not None:
        raise FivedcError(f"--source names the model of a plan; {args.model} is itself the model",
                          hint="drop --source")
    return plan


PLAN_FLAGS = ("mesh", "rank_order", "sp", "cp_attention", "attention_kernel", "cp_layout", "zero", "bucket_mb", "schedule", "microbatches",
              "virtual", "pp_layout", "overlap", "stage_boundary", "dtype", "recompute", "layers", "fp8")


def plan_flags_given(args, defaults) -> list[str]:
    """The options that shape a plan given on the command line (not left at their defaults)."""
    names = {"sp": "--sp/--no-sp", "overlap": "--no-overlap"}
    return [names.get(k, "--" + k.replace("_", "-")) for k in PLAN_FLAGS
            if getattr(args, k, None) != getattr(defaults, k, None)]  # a command may not have every flag
