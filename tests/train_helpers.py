"""What the `fivedc train` tests share: token files, plans, jobs and the single-device run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.data import TokenFile, check_token_file
from fivedc.runtime.pool_worker import RankInfo
from fivedc.runtime.train_loop import TrainJob, train_rank
from fivedc.runtime.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def make_tokens(folder: Path, *, tokens: int = 3000, val: int = 600, vocab: int = 64, seed: int = 0) -> tuple[str, str]:
    """train.bin and val.bin of examples/make_data.py's synthetic language, in `folder`."""
    from fivedc.frontends.python_file import import_file

    make_data = import_file(ROOT / "examples" / "make_data.py")
    both, _ = make_data.markov(tokens + val, vocab=vocab, seed=seed)
    paths = folder / "train.bin", folder / "val.bin"
    both[:tokens].astype(np.uint16).tofile(paths[0])
    both[tokens:].astype(np.uint16).tofile(paths[1])
    return str(paths[0]), str(paths[1])


def plan_of(model: str, mesh: str, *, dtype: str = "fp64", **options):
    graph = load_model(str(ROOT / "examples" / f"{model}.5d"))
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype=dtype, **options))


def job_for(plan, data: tuple[str, str], **config) -> TrainJob:
    train, val = data
    tokens = check_token_file(train, "uint16", graph=plan.graph, what="training")
    val_tokens = check_token_file(val, "uint16", graph=plan.graph, what="validation")
    return TrainJob(plan=plan, config=TrainConfig(**config), train=TokenFile(train), train_tokens=tokens,
                    val=TokenFile(val), val_tokens=val_tokens)


def one_device(job: TrainJob) -> list[dict]:
    """The rows of the job trained in this process on one device, on one thread (tiny
    matmuls on two busy cores run ten times slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_rank(RankInfo(0, 1, "cpu"), job)["rows"]
    finally:
        torch.set_num_threads(threads)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)
