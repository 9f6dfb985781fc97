"""The shard files of a checkpoint: inside its folder, readable headers, the bytes that were saved.

When a rank saves, it records its file's size and sha256 beside it (`record_digest`);
rank 0 puts them in the index under `files` (`collect_digests`). Before a resume or an
export, `check_files` checks every file the index names (each piece's, and every
rank's for its RNG state): a regular file inside the checkpoint's folder (a symlink
that leads out of it is refused), the size and sha256 recorded (a truncated file or a
flipped byte is caught before any rank reads it), and a safetensors header that
parses, with every piece's key at the dtype and shape the index gives. A checkpoint
saved before digests existed has no `files`: it is read with every other check but
no digest (`check_files` returns False, and the command says so). sha256 runs at
about 1-2 GB/s, a small share of writing or reading the same bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from fivedc.errors import CheckpointError
from fivedc.runtime.checkpoint_check import RANK_FILE
from fivedc.runtime.checkpoint_dirs import damaged_hint

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "uint8"}
DIGEST_SUFFIX = ".digest.json"  # a rank's digest beside its file until rank 0 collects it
CHUNK = 1 << 22
RNG_BYTES = 5056  # torch.get_rng_state().numel(): the CPU generator's state


def file_digest(path: Path) -> dict:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while block := file.read(CHUNK):
            sha.update(block)
            size += len(block)
    return {"bytes": size, "sha256": sha.hexdigest()}


def record_digest(path: Path) -> None:
    """A rank's file's digest, beside it (collected into the index by rank 0)."""
    path.with_name(path.name + DIGEST_SUFFIX).write_text(json.dumps(file_digest(path)))


def collect_digests(folder: Path, files: list[str]) -> dict[str, dict]:
    """The digests the ranks recorded, by file; their side files removed."""
    out = {}
    for name in files:
        side = folder / (name + DIGEST_SUFFIX)
        out[name] = json.loads(side.read_text())
        side.unlink()
    return out


def check_files(folder: Path, index: dict) -> bool:
    """Every file the index names, checked; False when the index has no digests to check."""
    digests = index.get("files")
    by_file: dict[str, list[tuple[str, dict, dict]]] = {}
    for key, entry in index["tensors"].items():
        for piece in entry["pieces"]:
            by_file.setdefault(piece["file"], []).append((key, entry, piece))
    ranks = (f"rank-{r:05d}.safetensors" for r in range(index["world"]))  # lazily: a huge world fails at once
    for name in _unique(itertools.chain(sorted(by_file), ranks)):
        path = _inside(folder, name)
        if digests is not None:
            _check_digest(path, digests.get(name), folder)
        _check_header(path, by_file.get(name, []), folder)
    return digests is not None


def _unique(names):
    seen = set()
    for name in names:
        if name not in seen:
            seen.add(name)
            yield name


def check_digest_field(files, fail) -> None:
    """The index's `files` field: {rank file: {"bytes": n, "sha256": hex}} (or absent)."""
    if files is None:
        return
    if not isinstance(files, dict):
        fail("files", "is not an object")
    for name, digest in files.items():
        ok = (RANK_FILE.fullmatch(name) and isinstance(digest, dict) and isinstance(digest.get("bytes"), int)
              and isinstance(digest.get("sha256"), str) and len(digest["sha256"]) == 64)
        if not ok:
            fail(f"files[{name!r}]", "is not {\"bytes\": N, \"sha256\": HEX} of a rank file")


def _inside(folder: Path, name: str) -> Path:
    path = folder / name
    root = folder.resolve()
    if not path.exists() and not path.is_symlink():
        _fail(folder, f"lists {name}, which is missing")
    target = path.resolve()
    if not target.is_relative_to(root):
        _fail(folder, f"has {name} as a symlink to {target}, outside the checkpoint's folder")
    if not target.is_file():
        _fail(folder, f"has {name}, which is not a regular file")
    return target


def _check_digest(path: Path, digest: dict | None, folder: Path) -> None:
    if digest is None:
        _fail(folder, f"records no digest of {path.name}, which its pieces use")
    size = path.stat().st_size
    if size != digest["bytes"]:
        _fail(folder, f"has {path.name} of {size} bytes; {digest['bytes']} were saved: the file is truncated "
                      "or changed")
    if file_digest(path)["sha256"] != digest["sha256"]:
        _fail(folder, f"has {path.name} whose bytes changed since it was saved (its sha256 differs from the "
                      "index's)")


def _check_header(path: Path, pieces: list[tuple[str, dict, dict]], folder: Path) -> None:
    """The safetensors header parses and holds every piece at its dtype and shape."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            keys = set(file.keys())
            shapes = {k: (file.get_slice(k).get_dtype(), file.get_slice(k).get_shape()) for k in keys}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        _fail(folder, f"has {path.name}, which is not a readable safetensors file ({_short(error)})")
    for key, entry, piece in pieces:
        if piece["key"] not in keys:
            _fail(folder, f"has no tensor {piece['key']} in {path.name}, where the index puts a piece of {key}")
        dtype, shape = shapes[piece["key"]]
        want = [piece["flat"][1] - piece["flat"][0]] if piece["flat"] else _block_shape(piece["block"])
        if SAFETENSORS_DTYPES.get(dtype) != entry["dtype"] or list(shape) != want:
            _fail(folder, f"has {piece['key']} in {path.name} as {dtype} {list(shape)}; the index says "
                          f"{entry['dtype']} {want}")
    if "rng/torch" in shapes and shapes["rng/torch"] != ("U8", [RNG_BYTES]):
        _fail(folder, f"has an RNG state in {path.name} of {shapes['rng/torch']}, not torch's {RNG_BYTES} bytes")


def _block_shape(block: list[str]) -> list[int]:
    return [sum(int(b) - int(a) for a, b in (run.split(":") for run in text.split(","))) for text in block]


def _short(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:120]


def _fail(folder: Path, what: str):
    raise CheckpointError(f"the checkpoint {folder} {what}", hint=damaged_hint(folder))


__all__ = ["check_digest_field", "check_files", "collect_digests", "file_digest", "record_digest"]
