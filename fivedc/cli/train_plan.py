"""The plan `fivedc train` runs: a saved plan, the model compiled for `--mesh`, or for `--mesh auto`.

`--mesh auto` takes the world the run finds (torchrun's `WORLD_SIZE`: after a restart
with fewer nodes, the smaller one) and the layout `fivedc search` ranks first for that
many GPUs of `--gpu` (default h100): its mesh and every option it chooses (schedule,
microbatches, ZeRO, SP, recomputation, rank order), so flags that would fix one of those
are refused; the precision (`--dtype`, `--fp8`: float8 linears on every layout) is the user's. Every rank searches alike (the search is deterministic) and gets the same
plan. A checkpoint saved on another layout is read into this one as any resume is
(`runtime/reshard.py`), and the run says so.
"""

from __future__ import annotations

import os

from fivedc.errors import FivedcError

AUTO = "auto"
DEFAULT_GPU = "h100"  # the profile --mesh auto searches for without --gpu
FREE_FLAGS = ("--mesh", "--dtype", "--stage-boundary", "--fp8")  # flags --mesh auto leaves to the user


def train_plan(args, defaults, *, launched: bool):
    """(plan, module, note): the plan; for a `file.py:factory` model (module, its
    TracedModel), else None; a line saying what `--mesh auto` chose, else None."""
    from fivedc.cli.plan_check import load_plan
    from fivedc.cli.shared import plan_flags_given

    if args.model.endswith(".json"):
        given = plan_flags_given(args, defaults)
        if given:
            raise FivedcError(f"{args.model} is a compiled plan: its mesh and options are fixed, and "
                              f"{', '.join(given)} would change them",
                              hint="drop them, or train the model file (.5d or file.py:factory) with the new options")
        return load_plan(args.model), None, None
    if args.mesh is None:
        raise FivedcError(f"training {args.model} needs a mesh",
                          hint="add --mesh DPxPPxTPxCPxEP, e.g. --mesh 2x1x2x1x1, or --mesh auto under torchrun")
    if args.mesh == AUTO:
        return _auto(args, defaults, launched=launched)
    return (*_compiled(args), None)


def _compiled(args):
    from fivedc.cli.shared import compile_model, compile_options
    from fivedc.frontends.python_file import is_spec, traced_from_spec
    from fivedc.ir.mesh import Mesh
    from fivedc.pipeline import compile_graph

    if not is_spec(args.model):
        return compile_model(args.model, args.mesh, args, dtype=args.dtype or "fp32"), None
    options = compile_options(args, Mesh.parse(args.mesh, rank_order=args.rank_order), dtype=args.dtype or "fp32")
    module, _, traced = traced_from_spec(args.model, stage_boundaries=tuple(args.stage_boundary))
    return compile_graph(traced.graph, options), (module, traced)


def _auto(args, defaults, *, launched: bool):
    from fivedc.cli.shared import load_graph, plan_flags_given
    from fivedc.frontends.python_file import is_spec, traced_from_spec
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import search

    if not launched:
        raise FivedcError("--mesh auto takes the world a launcher finds (torchrun's WORLD_SIZE), and this run "
                          "starts its own processes", hint="give the mesh, e.g. --mesh 2x1x1x1x1, or start the "
                          "command under torchrun (torchrun --nproc-per-node 2 -m fivedc -- train ...)")
    fixed = [flag for flag in plan_flags_given(args, defaults) if flag not in FREE_FLAGS]
    if fixed:
        raise FivedcError(f"--mesh auto lets the search choose the layout and its options, and {', '.join(fixed)} "
                          "would fix some of them", hint="drop them, or give the mesh yourself")
    world = int(os.environ["WORLD_SIZE"])
    module = None
    if is_spec(args.model):
        module, _, traced = traced_from_spec(args.model, stage_boundaries=tuple(args.stage_boundary))
        graph, module = traced.graph, (module, traced)
    else:
        graph = load_graph(args.model, args.stage_boundary)
    hw = hardware(args.gpu or DEFAULT_GPU, tuple(args.hardware))
    result = search(graph, gpus=world, hardware=hw, dtype=args.dtype or "fp32", keep=1, fp8=args.fp8)
    profile = "" if args.gpu else f" (--gpu {DEFAULT_GPU}: the default profile)"
    note = (f"mesh auto: {world} process{'es' if world > 1 else ''}; the search ranks first, on {world} x "
            f"{hw.key}{profile}: "
            f"{result.best.candidate.flags()}")
    return result.plan, module, note


__all__ = ["AUTO", "DEFAULT_GPU", "train_plan"]
