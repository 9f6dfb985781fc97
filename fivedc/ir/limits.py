"""The sizes fivedc plans for: bounds that keep every command's work to seconds.

A model, a flag or a plan file can ask for sizes no real training run has (a billion
ranks, a million layers, a repeat of 10^9 in an edited plan), and some of fivedc's work
grows with them: the stage partition and the schedule with layers and microbatches, the
agreement proof with chunks. Each bound is checked where the size enters (the mesh, the
graph, a pipeline, a plan's JSON), with the number, the bound and the fix; a plan file
meets the same bounds when it is loaded. The bounds and why they are generous:

- `MAX_WORLD` 2^20 ranks: the largest training clusters are about 10^5 GPUs; planning
  cost does not grow with the world (a 2^20-rank plan compiles and checks in about 1 s).
- `MAX_LAYERS` 2048 layers in all repeats: production decoders have at most about 130,
  the deepest published transformer (DeepNet) 1000; at 2048 layers a 32-stage
  interleaved pipeline compiles in about 4 s and checks in about 7 s (cost grows with
  the layers: 10^5 take 22 s and 1.2 GB without a pipeline, 10^6 minutes and 5 GB).
- `MAX_DIM` 2^31 for one dim (a vocabulary, a global batch in sequences, a sequence in
  tokens): kernels index with 32-bit offsets, and no run comes near it.
- `MAX_SLOTS` 2^16 microbatches x pipeline chunks (pp x virtual stages) per step: the
  schedule lists every microbatch's actions on every chunk, and the planning passes and
  the agreement proof walk it. Published runs reach 32768 (Narayanan et al. 2021's 1T
  GPT: 512 microbatches through 64 stages; benchmarks/validation.py), which compiles
  in about 4 s and checks in about 7 s with 135 MB on 2 cores.
- `MAX_JSON_DEPTH` 64 levels in a plan file: a plan nests about 15 deep; a deeper file
  would exhaust Python's stack while it is read.
"""

from __future__ import annotations

from fivedc.errors import FivedcError, SourceLoc

MAX_WORLD = 2**20
MAX_LAYERS = 2048
MAX_DIM = 2**31
MAX_SLOTS = 2**16
MAX_JSON_DEPTH = 64


class LimitError(FivedcError):
    """A size beyond what fivedc plans for (bad input: exit 2)."""


def check_world(world: int, *, what: str, hint: str = "") -> None:
    if world > MAX_WORLD:
        raise LimitError(f"{what} has {world} ranks; fivedc plans for at most 2^20 = {MAX_WORLD}",
                         hint=hint or "use a smaller mesh (the largest clusters have about 10^5 GPUs)")


def check_dim(name: str, size: int, *, loc: SourceLoc | None = None) -> None:
    if size > MAX_DIM:
        raise LimitError(f"dim {name} = {size} is larger than fivedc plans for (at most 2^31 = {MAX_DIM})",
                         loc=loc, hint=f"give {name} a real size (a global batch in sequences, a sequence in "
                         "tokens, a vocabulary)")


def check_layers(total: int, *, loc: SourceLoc | None = None) -> None:
    if total > MAX_LAYERS:
        raise LimitError(f"the model has {total} layers in its repeats; fivedc plans for at most {MAX_LAYERS}",
                         loc=loc, hint="use fewer layers (the deepest published transformers have about 1000)")


def check_microbatches(count: int, *, chunks: int = 1) -> None:
    """`count` microbatches through `chunks` pipeline chunks (pp x virtual stages) per step."""
    if count * max(chunks, 1) > MAX_SLOTS:
        raise LimitError(f"{count} microbatches x {chunks} pipeline chunks = {count * chunks} schedule slots "
                         f"per step; fivedc plans for at most {MAX_SLOTS}",
                         hint=f"use fewer, larger microbatches: at most {MAX_SLOTS // max(chunks, 1)} here")


def json_depth(data: object) -> int:
    """How deep lists and objects nest in decoded JSON, without recursion (up to MAX_JSON_DEPTH + 1)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if not isinstance(obj, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return deepest
