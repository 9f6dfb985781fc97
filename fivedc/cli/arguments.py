"""The `fivedc` command line: every subcommand's options, in the order `--help` lists them.

`build_parser` adds the subcommands in order, each from its own function here (`search`,
`rehearse` and `train` take theirs from their own modules); the options several share
(the mesh, what shapes a plan, how local processes start) are a function each.
"""

from __future__ import annotations

import argparse

from fivedc.cli import screen
from fivedc.cli.rehearse import rehearse_args
from fivedc.cli.train import train_args
from fivedc.errors import EXIT_CODES
from fivedc.runtime import DEFAULT_TIMEOUT_S
from fivedc.schedule.kinds import schedules_help

COMMANDS = {
    "compile": "compile a model for a mesh: write the plan and print a readable summary",
    "show": "list a plan's ops with their ids (--ops), print one rank's step as instructions (--program), or "
            "draw its pipeline schedule (--schedule out.png)",
    "verify": "train a few steps with the plan on local processes and compare with one device",
    "run": "execute a plan (or compile a model and execute it): loss, step time and memory per rank",
    "train": "train a model (or a plan) on token files: validation, checkpoints, resume on any mesh",
    "export": "consolidate a checkpoint into one .safetensors file with the model's own parameter names",
    "diff": "compare two plans (or model@mesh pairs): mesh, sharding, collectives, memory",
    "check": "check a saved plan: exactly what this fivedc compiles, and every group's ranks agree on its collectives",
    "rehearse": "run one rank of each class of a plan at full scale (on the meta device, or timed on cpu or "
    "cuda): its peak memory and step against the estimate",
    "search": "find the fastest layout (mesh and options) of a model on N GPUs: ranked, and the best plan written",
}


def _mesh_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--mesh", required=required, help="DPxPPxTPxCPxEP (e.g. 8x16x8x4x4) or dp=2,tp=2")
    p.add_argument("--rank-order", default=None, help="innermost axis first (default tp,cp,ep,dp,pp)")
    sp = p.add_mutually_exclusive_group()
    sp.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallelism on")
    sp.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    _plan_option_args(p)


def _plan_option_args(p: argparse.ArgumentParser) -> None:
    """What besides the mesh and --sp shapes a plan: CP, ZeRO and buckets, the pipeline, recomputation."""
    from fivedc.passes.base import ATTENTION_KERNELS, CP_LAYOUTS, CP_VARIANTS, DEFAULT_BUCKET_MB
    from fivedc.passes.recompute import RECOMPUTE_MODES

    p.add_argument("--cp-attention", choices=CP_VARIANTS, default=None,
                   help="attention across cp: ring (default) or allgather; an op's @cp(...) wins")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                   help="attention's kernel: flash (default; scores never held), flash2 (the same, "
                   "pinned to FlashAttention-2: SDPA's flash backend) or math (scores materialised and "
                   "kept, as Megatron-LM before flash attention); an op's kernel= wins")
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, default=None,
                   help="sequence layout over cp (default balanced when attention is causal)")
    p.add_argument("--zero", type=int, default=0, metavar="STAGE",
                   help="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters (default 0: off)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                   help=f"gradient bucket size in MiB (default {DEFAULT_BUCKET_MB:g})")
    p.add_argument("--schedule", default=None, help=f"pipeline schedule for pp > 1: {schedules_help()}")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: max(pp, least))")
    p.add_argument("--virtual", type=int, default=None, help="chunks per pp rank for interleaved (default 2)")
    p.add_argument("--pp-layout", default=None, metavar="N,N,...",
                   help="layers per chunk instead of balancing by cost, e.g. 3,5,5,3")
    p.add_argument("--stage-boundary", action="append", default=[], metavar="PATTERN",
                   help="file.py:factory models: a pipeline chunk begins at the modules matching PATTERN "
                   "(e.g. layers.4; * matches one path element); repeat for more")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="sum gradients after backward, no ZeRO-3 prefetch, tensor parallelism's backward sums "
                   "not behind the weight gradients, its forward collectives not beside their linears (to measure "
                   "what overlap gains)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="activation recomputation: none, selective (attention recomputed in backward) or "
                   "full (each layer keeps only its input); default: the model's @recompute, else none")
    p.add_argument("--fp8", action="store_true",
                   help="linears' matmuls in float8 as torchao's tensorwise recipe runs them (e4m3 inputs and "
                   "weights, e5m2 gradients, dynamic scales; not the output head, attention or MoE experts)")


def _wide_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wide", action="store_true",
                   help=f"print for a terminal of {screen.WIDE_COLUMNS}+ columns (default: at most {screen.MAX_COLUMNS})")


def _local_run_args(p: argparse.ArgumentParser) -> None:
    """How verify and run start their local processes."""
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"how long a rank waits in one collective for the others before the run fails "
                   f"(default {DEFAULT_TIMEOUT_S:g}); a long computation never times out")
    p.add_argument("--force", action="store_true",
                   help="start the local processes even when the mesh or the plan's memory estimate "
                   "exceeds this machine")
    p.add_argument("--compile", action="store_true",
                   help="run each layer of a repeat as one torch.compile region (compiled once for every layer)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivedc",
        description="A declarative compiler from a model graph to a 5-D parallel execution plan.",
        epilog="exit codes:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from fivedc import __version__

    parser.add_argument("--version", action="version", version=f"fivedc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, add_options in SUBCOMMANDS:
        add_options(sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name]))
    return parser


def _compile_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("model", help="a .5d model file, or path/to/file.py:factory (an nn.Module traced with torch.fx)")
    _mesh_args(c, required=True)
    c.add_argument("--dtype", default="bf16", help="training precision for the estimates (bf16, fp32, fp64)")
    c.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="sequences per step instead of the model's batch dim (as fivedc search takes it)")
    c.add_argument("--seq", type=int, default=None, metavar="S",
                   help="tokens per sequence instead of the model's sequence dim (as fivedc search takes it)")
    c.add_argument("-o", "--output", default=None, help="plan file to write (default MODEL.plan.json)")
    c.add_argument("-q", "--quiet", action="store_true", help="write the plan, print one line")
    c.add_argument("-v", "--verbose", action="store_true", help="list every parameter")
    c.add_argument("--wide", action="store_true", help="summary as wide tables (140+ columns; default: the terminal's, at most 100, 80 when piped)")
    c.add_argument("--passes", action="store_true", help="list the compiler's passes in order, with their times")
    c.add_argument("--no-weights", dest="weights", action="store_false",
                   help="file.py:factory: build the model under fivedc.empty_weights() (parameters on the meta "
                   "device, none allocated): the same plan, so a large config plans on a laptop")
    c.add_argument("--gpu", default=None, metavar="NAME",
                   help="estimate the step time on this GPU (h100, h800, a100, h200, tpu-v4, or one from --hardware) and "
                   "check that every rank fits its memory (exit 2 with what would make it fit)")
    c.add_argument("--hardware", action="append", default=[], metavar="FILE",
                   help="a TOML file of GPU profiles like fivedc/ir/hardware.toml, added to the built-in ones")


def _verify_options(v: argparse.ArgumentParser) -> None:
    v.add_argument("model", help="a .5d model file, or path/to/file.py:factory (checked against the plain module)")
    _mesh_args(v, required=True)
    v.add_argument("--steps", type=int, default=2, help="AdamW steps (default 2)")
    v.add_argument("--dtype", default="fp64", help="fp64 (default) or fp32")
    v.add_argument("--tol", type=float, default=None, help="largest relative error allowed (fp64: 1e-10)")
    v.add_argument("--trace-divergence", action="store_true",
                   help="compare every op's value and gradient too, and name the first that differs (a mismatch "
                   "does this by itself in a second run)")
    v.add_argument("--inject-fault", default=None, metavar="OP[@RANK]",
                   help="the checker's self-test: perturb OP's output (an id from fivedc show PLAN --ops) on one "
                   "rank; verify must fail naming OP")
    _local_run_args(v)
    v.add_argument("--seed", type=int, default=0)


def _run_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("model", help="a plan .json written by fivedc compile, a .5d model, or path/to/file.py:factory")
    _mesh_args(r, required=False)
    r.add_argument("--steps", type=int, default=10, help="AdamW steps (default 10)")
    r.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp64, for a model compiled here")
    r.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    r.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    r.add_argument("--seed", type=int, default=0, help="seed of the parameters and the synthetic batch")
    r.add_argument("--source", default=None, metavar="MODEL",
                   help="for a plan: the model file it was compiled from (default: the file the plan names)")
    r.add_argument("--report", default=None, metavar="OUT.json",
                   help="write per rank the plan's memory estimate and what the run measured (bytes kept for "
                   "backward, parameters, gradients and optimizer state held; on CUDA the allocator's peak)")
    _local_run_args(r)


def _train_options(t: argparse.ArgumentParser) -> None:
    t.add_argument("model", help="a .5d model, path/to/file.py:factory (starts from the module's weights) or a plan .json")
    _mesh_args(t, required=False)
    train_args(t)
    _local_run_args(t)


def _export_options(e: argparse.ArgumentParser) -> None:
    e.add_argument("checkpoint", help="a save directory (its latest checkpoint) or one step-N folder")
    e.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    e.add_argument("--strip-prefix", default=None, metavar="PREFIX",
                   help="drop PREFIX from the names (a wrapper's, e.g. model.) so the library's own model loads them")
    e.add_argument("--dtype", default=None, help="cast to fp64, fp32, bf16 or fp16 (default: as trained)")


def _show_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("plan", help="a plan .json written by fivedc compile")
    s.add_argument("--schedule", default=None, metavar="OUT", help="draw the pipeline schedule: a .png or .svg")
    s.add_argument("--ops", action="store_true",
                   help="list every op and redistribution with its id (what --inject-fault and a divergence name)")
    s.add_argument("--program", action="store_true",
                   help="print one rank's training step as its instruction list: computations, collectives and "
                        "transfers in issue order (what the agreement proof checks)")
    s.add_argument("--rank", type=int, default=0, help="the rank whose program --program prints (default 0)")
    _wide_arg(s)


def _diff_options(d: argparse.ArgumentParser) -> None:
    d.add_argument("a", help="a plan .json, or MODEL.5d@MESH")
    d.add_argument("b", help="a plan .json, or MODEL.5d@MESH")
    d.add_argument("--rank-order", default=None, help="rank order for model@mesh arguments")
    d.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallel for model@mesh")
    _plan_option_args(d)
    d.add_argument("--json", action="store_true", help="machine-readable output")
    _wide_arg(d)


def _rehearse_options(h: argparse.ArgumentParser) -> None:
    h.add_argument("model", help="a plan .json written by fivedc compile, a .5d model, or path/to/file.py:factory")
    _mesh_args(h, required=False)
    rehearse_args(h)


def _search_options(p: argparse.ArgumentParser) -> None:
    from fivedc.cli.search import search_args

    search_args(p)


def _check_options(k: argparse.ArgumentParser) -> None:
    k.add_argument("plan", help="a plan .json written by fivedc compile")
    k.add_argument("--source", default=None, metavar="MODEL",
                   help="the model file the plan was compiled from (default: the file the plan names)")
    k.add_argument("--collectives", action="store_true",
                   help="list what each class of ranks (one per pp rank) issues in one step, in order")


SUBCOMMANDS = (  # in the order --help lists them
    ("compile", _compile_options), ("verify", _verify_options), ("run", _run_options), ("train", _train_options),
    ("export", _export_options), ("show", _show_options), ("diff", _diff_options),
    ("rehearse", _rehearse_options), ("search", _search_options), ("check", _check_options),
)
