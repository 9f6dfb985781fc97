"""Hardware profiles for the step-time model: a data file users can extend.

`fivedc/ir/hardware.toml` holds the built-in profiles (H100 SXM, H800, A100, H200); a
user's file of the same form (`--hardware FILE`) adds profiles or replaces one of the
same name. `hardware(name, files)` returns one as a frozen `Hardware`, which a plan
records whole (so a plan compiled with a user's profile still checks without the
file). A profile missing a field, or with one that is not a positive number, is a
`HardwareError` naming the file, the profile and the field.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fivedc.errors import FivedcError

GiB = 2**30


class HardwareError(FivedcError):
    """A hardware profile that is unknown, or a profile file that cannot be read."""


@dataclass(frozen=True, slots=True)
class Hardware:
    key: str  # the profile's name: h100, h800, ...
    name: str  # what it is, for people
    bf16_flops: float
    hbm_bytes_per_s: float
    memory_gib: float
    reserved_gib: float
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    gpus_per_node: int
    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    link_efficiency: float
    nvlink_latency_s: float
    internode_latency_s: float
    overlap_sm_share: float = 0.0  # of the compute units, what a collective beside compute takes
    op_memory_efficiency: float | None = None  # of hbm, what forward and backward's memory-bound ops reach
    op_latency_s: float = 0.0  # the host's time to issue one op, forward or backward, beyond its work
    host_runs_ahead: bool = False  # a GPU's stream: the host issues the next op while this one runs
    fp8_flops: float | None = None  # dense float8 tensor-core peak; None: the GPU has no float8 matmuls
    sm_count: int | None = None  # the SMs a GEMM's tiles run over in waves (`fivedc/estimates/gemm.py`)
    matmul_tiles: tuple[tuple[int, int, int], ...] = ()  # the (M, N, K) tiles of the GEMM kernels it picks among
    tree_all_reduce: bool = False  # NCCL: an all-reduce across nodes by a tree where faster than a ring
    flash2_efficiency: float | None = None  # of bf16_flops, what FlashAttention-2 reaches; None: attention_efficiency

    def attention_share(self, kernel: str) -> float:
        """Of bf16_flops, what a fused attention kernel reaches: `flash2` (FlashAttention-2, as
        torch's SDPA flash backend runs it) at `flash2_efficiency` where the profile gives one,
        else, like `flash`, at `attention_efficiency`."""
        if kernel == "flash2" and self.flash2_efficiency is not None:
            return self.flash2_efficiency
        return self.attention_efficiency

    @property
    def tiled(self) -> bool:
        """GEMMs are priced by their shape (tiles in waves over the SMs), not at the flat rate."""
        return self.sm_count is not None and bool(self.matmul_tiles)

    @property
    def op_bytes_per_s(self) -> float:
        """What the forward and backward's memory-bound ops (norms, activations, adds) move per
        second: `op_memory_efficiency` of the bandwidth where a profile measured it (a runtime
        running them as several unfused kernels reaches less than one streaming pass), else
        `memory_efficiency`, as the optimizer's streaming update."""
        share = self.memory_efficiency if self.op_memory_efficiency is None else self.op_memory_efficiency
        return self.hbm_bytes_per_s * share

    @property
    def overlap_keep(self) -> float:
        """Of a collective's seconds run beside compute, the share that is hidden: the rest
        slows that compute (the collective's kernels hold SMs meanwhile)."""
        return 1.0 - self.overlap_sm_share

    @property
    def usable_bytes(self) -> int:
        """Memory for tensors: the GPU's less what CUDA, NCCL and the allocator take."""
        return int((self.memory_gib - self.reserved_gib) * GiB)


OPTIONAL = {"overlap_sm_share": 0.0, "op_memory_efficiency": None, "op_latency_s": 0.0,
            "host_runs_ahead": False, "fp8_flops": None, "sm_count": None, "matmul_tiles": (),
            "tree_all_reduce": False, "flash2_efficiency": None}  # a profile may leave these out
FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name not in ("key", "name", *OPTIONAL))


def builtin_text() -> str:
    return resources.files("fivedc.ir").joinpath("hardware.toml").read_text()


def profiles(files: tuple[str | Path, ...] = ()) -> dict[str, Hardware]:
    """The built-in profiles, then each file's (a later one replaces an earlier of the same name)."""
    found = _parse(builtin_text(), "fivedc/ir/hardware.toml")
    for path in files:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise HardwareError(f"cannot read the hardware file {path}: {error.strerror}",
                                hint="give a TOML file of profiles like fivedc/ir/hardware.toml") from None
        found.update(_parse(text, str(path)))
    return found


def hardware(name: str, files: tuple[str | Path, ...] = ()) -> Hardware:
    known = profiles(files)
    key = name.lower()
    if key not in known:
        raise HardwareError(f"unknown GPU {name!r}", hint=f"choose one of {', '.join(sorted(known))}, or add a "
                            "profile to a file given with --hardware FILE (the form of fivedc/ir/hardware.toml)")
    return known[key]


def _parse(text: str, source: str) -> dict[str, Hardware]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise HardwareError(f"{source} is not a TOML file of hardware profiles: {error}") from None
    out = {}
    for key, table in data.items():
        if not isinstance(table, dict):
            raise HardwareError(f"{source}: {key} is not a [profile] table")
        missing = [f for f in FIELDS if f not in table]
        if missing:
            raise HardwareError(f"{source}: profile [{key}] has no {', '.join(missing)}",
                                hint="every profile gives all of: " + ", ".join(FIELDS))
        for field in FIELDS:
            value = table[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise HardwareError(f"{source}: [{key}] {field} = {value!r} must be a positive number")
        if table["gpus_per_node"] != int(table["gpus_per_node"]) or table["reserved_gib"] >= table["memory_gib"]:
            raise HardwareError(f"{source}: [{key}] needs a whole gpus_per_node and reserved_gib below memory_gib")
        share = table.get("overlap_sm_share", OPTIONAL["overlap_sm_share"])
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise HardwareError(f"{source}: [{key}] overlap_sm_share = {share!r} must be a number in [0, 1)")
        values = {f: (int(table[f]) if f == "gpus_per_node" else float(table[f])) for f in FIELDS}
        values["overlap_sm_share"] = float(share)
        values["op_memory_efficiency"] = _optional_share(table, "op_memory_efficiency", source, key)
        values["flash2_efficiency"] = _optional_share(table, "flash2_efficiency", source, key)
        latency = table.get("op_latency_s", 0.0)
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < 1:
            raise HardwareError(f"{source}: [{key}] op_latency_s = {latency!r} must be seconds in [0, 1)")
        values["op_latency_s"] = float(latency)
        for flag in ("host_runs_ahead", "tree_all_reduce"):
            value = table.get(flag, False)
            if not isinstance(value, bool):
                raise HardwareError(f"{source}: [{key}] {flag} = {value!r} must be true or false")
            values[flag] = value
        fp8 = table.get("fp8_flops")
        if fp8 is not None and (isinstance(fp8, bool) or not isinstance(fp8, (int, float)) or not fp8 > 0):
            raise HardwareError(f"{source}: [{key}] fp8_flops = {fp8!r} must be a positive number of FLOP/s")
        values["fp8_flops"] = None if fp8 is None else float(fp8)
        values["sm_count"], values["matmul_tiles"] = _tiles(table, source, key)
        out[key.lower()] = Hardware(key.lower(), str(table.get("name", key)), **values)
    return out


def _optional_share(table: dict, field: str, source: str, key: str) -> float | None:
    """An optional share in (0, 1], or None where the profile leaves it out."""
    if field not in table:
        return None
    value = table[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise HardwareError(f"{source}: [{key}] {field} = {value!r} must be a number in (0, 1]")
    return float(value)


def _tiles(table: dict, source: str, key: str) -> tuple[int | None, tuple[tuple[int, int, int], ...]]:
    """The optional GEMM tile terms: both `sm_count` (a whole number) and `matmul_tiles` (a list
    of [M, N, K] tiles of whole numbers), or neither (GEMMs at the flat rate)."""
    sms, tiles = table.get("sm_count"), table.get("matmul_tiles")
    if sms is None and tiles is None:
        return None, ()
    if sms is None or tiles is None:
        raise HardwareError(f"{source}: [{key}] gives one of sm_count and matmul_tiles without the other",
                            hint="give both (GEMMs priced by their tiles in waves over the SMs) or neither")
    if isinstance(sms, bool) or not isinstance(sms, int) or sms <= 0:
        raise HardwareError(f"{source}: [{key}] sm_count = {sms!r} must be a whole number of SMs")
    whole = isinstance(tiles, list) and tiles and all(
        isinstance(t, list) and len(t) == 3 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in t)
        for t in tiles)
    if not whole:
        raise HardwareError(f"{source}: [{key}] matmul_tiles = {tiles!r} must be a list of [M, N, K] tiles "
                            "of whole numbers, e.g. [[128, 256, 64], [128, 128, 64]]")
    return sms, tuple(tuple(t) for t in tiles)
