"""A checkpoint is untrusted input: every field of its index is checked before anything uses it.

A checkpoint may come from someone else, or be damaged on disk. `check_index` (called by
`checkpoint.read_index`, so by every reader) type-checks each field the runtime reads:
`step`, `world`, the losses, `data`, `config` (then `TrainConfig`'s own checks),
`optimizer`, `plan`, `names` and every tensor's dtype, shape, dims and pieces (a piece's
file a bare `rank-NNNNN.safetensors` name, its block inside the tensor's shape, its flat
range inside the block). The shard files are checked by `checkpoint_files.check_files`.
A failure is a `CheckpointError` (exit 2) naming the file and the field, whose hint
never points back at the damaged checkpoint.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from fivedc.errors import CheckpointError
from fivedc.runtime.checkpoint_dirs import damaged_hint
from fivedc.runtime.train_config import MAX_STEPS

RANK_FILE = re.compile(r"rank-\d{5,}\.safetensors")
KINDS = ("param", "exp_avg", "exp_avg_sq", "master", "moe_bias", "state")
DTYPES = ("float64", "float32", "bfloat16", "float16")
CONFIG = {"steps": int, "lr": float, "min_lr": (float, None), "warmup": int, "weight_decay": float,
          "clip": float, "seed": int, "val_every": int, "val_batches": int, "save_every": int, "keep": int}
PLAN = {"hash": str, "model": str, "mesh": str, "zero": int, "dtype": str}


def _sizes(value, length: int | None = None) -> bool:
    return (isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)
            and (length is None or len(value) == length))


MAPPING = {  # a traced model's parameter map (`fx/params.ParamMapping`), field by field
    **{name: lambda v: isinstance(v, str) for name in ("ir_name", "param", "key", "module_path", "pattern")},
    "repeat": lambda v: v is None or isinstance(v, str), "ir_shape": _sizes, "key_shape": _sizes,
    "rows": lambda v: v is None or _sizes(v, 2), "transpose": lambda v: isinstance(v, bool),
    "index": lambda v: v is None or (_is_int(v) and v >= 0), "axis": lambda v: _is_int(v) and v >= 0,
}


def check_index(index: dict, path: Path) -> None:
    """Every field of the index at `path` (format and version already checked)."""
    check = _Checker(path)
    check.number(index, "step", int, least=0, most=MAX_STEPS)
    check.number(index, "world", int, least=1)
    check.number(index, "val_loss", (float, None))
    best = check.mapping(index, "best", optional=True)
    if best is not None:
        check.number(best, "step", int, least=0, where="best.")
        check.number(best, "val_loss", float, where="best.")
    data = check.mapping(index, "data", optional=True)
    if data is not None:
        check.text(data, "train", where="data.")
    _check_config(check, check.mapping(index, "config"))
    optimizer = check.mapping(index, "optimizer")
    check.number(optimizer, "steps_taken", int, least=0, where="optimizer.")
    check.number(optimizer, "lr", float, where="optimizer.")
    plan = check.mapping(index, "plan")
    for name, kind in PLAN.items():
        if kind is int:
            check.number(plan, name, int, least=0, where="plan.")
        else:
            check.text(plan, name, "plan.")
    _check_names(check, index.get("names"))
    tensors = check.mapping(index, "tensors")
    if not tensors:
        check.fail("tensors", "is empty")
    for key, entry in tensors.items():
        _check_tensor(check, key, entry)


def _check_config(check: _Checker, config: dict) -> None:
    from fivedc.errors import FivedcError
    from fivedc.runtime.train_config import TrainConfig

    for name, kind in CONFIG.items():
        check.number(config, name, kind, least=0 if kind is int else None, where="config.")
    try:
        TrainConfig(**{name: config[name] for name in CONFIG})
    except FivedcError as error:
        check.fail("config", f"does not hold: {error.message}")


def _check_names(check: _Checker, names) -> None:
    if names is None:
        return
    from fivedc.frontends.fx.params import ParamMapping

    if not isinstance(names, dict) or not isinstance(names.get("params"), list):
        check.fail("names", "is not {\"params\": [...], \"aliases\": {...}}")
    for n, mapping in enumerate(names["params"]):
        try:
            ParamMapping(**{k: tuple(v) if isinstance(v, list) else v for k, v in mapping.items()})
        except (TypeError, AttributeError):
            check.fail(f"names.params[{n}]", "is not a parameter mapping")
        for field, ok in MAPPING.items():
            if not ok(mapping.get(field)) and (field in mapping or field in ("ir_name", "key", "ir_shape")):
                check.fail(f"names.params[{n}].{field}", f"is {_show(mapping.get(field))}")
    aliases = names.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, list) and all(isinstance(s, str) for s in v)
                                                for v in aliases.values()):
        check.fail("names.aliases", "is not a map from a name to a list of names")


def _check_tensor(check: _Checker, key, entry) -> None:
    where = f"tensors[{key!r}]"
    if not isinstance(key, str) or key.split("/", 1)[0] not in KINDS or "/" not in key:
        check.fail(where, f"is not a key like param/NAME ({', '.join(KINDS)})")
    if not isinstance(entry, dict):
        check.fail(where, "is not an object")
    if entry.get("dtype") not in DTYPES:
        check.fail(f"{where}.dtype", f"is {entry.get('dtype')!r}, not one of {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        check.fail(f"{where}.shape", f"is {_show(shape)}, not a list of sizes")
    dims = entry.get("dims")
    if not isinstance(dims, list) or len(dims) != len(shape) or not all(isinstance(d, str) for d in dims):
        check.fail(f"{where}.dims", f"is {_show(dims)}, not {len(shape)} dim names")
    pieces = entry.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        check.fail(f"{where}.pieces", f"is {_show(pieces)}, not a list of pieces")
    held = sum(_check_piece(check, f"{where}.pieces[{n}]", piece, shape) for n, piece in enumerate(pieces))
    if held != math.prod(shape):
        check.fail(f"{where}.pieces", f"hold {held} elements; its shape {shape} has {math.prod(shape)}")


def _check_piece(check: _Checker, where: str, piece, shape: list[int]) -> int:
    """Check one piece; the number of elements it holds."""
    if not isinstance(piece, dict):
        check.fail(where, "is not an object")
    name = piece.get("file")
    if not isinstance(name, str) or not RANK_FILE.fullmatch(name):
        check.fail(f"{where}.file", f"is {_show(name)}, not a file of the checkpoint's folder "
                   f"(rank-NNNNN.safetensors)")
    check.text(piece, "key", where + ".")
    block = piece.get("block")
    runs = _runs(block)
    if runs is None or len(runs) != len(shape):
        check.fail(f"{where}.block", f"is {_show(block)}, not {len(shape)} dims of runs like '0:16,48:64'")
    for dim_runs, size in zip(runs, shape):
        if any(not 0 <= a < b <= size for a, b in dim_runs) and size > 0:
            check.fail(f"{where}.block", f"is {_show(block)}: a run lies outside the tensor's shape {shape}")
    numel = math.prod(sum(b - a for a, b in r) for r in runs)
    flat = piece.get("flat")
    if flat is not None and not (isinstance(flat, list) and len(flat) == 2 and all(_is_int(v) for v in flat)
                                 and 0 <= flat[0] <= flat[1] <= numel):
        check.fail(f"{where}.flat", f"is {_show(flat)}, not null or [start, stop] within the block's {numel}")
    return numel if flat is None else flat[1] - flat[0]


def _runs(block) -> list[list[tuple[int, int]]] | None:
    if not isinstance(block, list) or not all(isinstance(t, str) for t in block):
        return None
    try:
        return [[(int(a), int(b)) for a, b in (run.split(":") for run in text.split(","))] for text in block]
    except ValueError:
        return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Checker:
    """Field checks that raise a `CheckpointError` naming the index and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, what: str):
        raise CheckpointError(f"the checkpoint index {self.path}: {field} {what}",
                              hint=damaged_hint(self.path.parent))

    def mapping(self, parent: dict, name: str, *, optional: bool = False) -> dict | None:
        value = parent.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            self.fail(name, "is missing" if name not in parent else f"is {_show(value)}, not an object")
        return value

    def text(self, parent: dict, name: str, where: str = "") -> None:
        if not isinstance(parent.get(name), str):
            self.fail(where + name, "is missing" if name not in parent else f"is {_show(parent[name])}, not a string")

    def number(self, parent: dict, name: str, kind, *, least: int | None = None, most: int | None = None,
               where: str = "") -> None:
        value, kinds = parent.get(name), kind if isinstance(kind, tuple) else (kind,)
        if value is None and None in kinds:
            return
        if name not in parent:
            self.fail(where + name, "is missing")
        whole = int in kinds
        ok = _is_int(value) if whole else (isinstance(value, (int, float)) and not isinstance(value, bool)
                                           and math.isfinite(value))
        if not ok or (least is not None and value < least) or (most is not None and value > most):
            want = f"a whole number >= {least}" if whole and least is not None else (
                "a whole number" if whole else "a finite number")
            want += f" and <= {most}" if most is not None else ""
            self.fail(where + name, f"is {_show(value)}, not {want}")


__all__ = ["RANK_FILE", "check_index"]
