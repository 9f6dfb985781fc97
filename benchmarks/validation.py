"""Published training runs against fivedc's estimates: predicted / measured step time and activations.

Each row is a run a paper measured, compiled at its exact shape, layout, batch,
microbatch, schedule, recomputation and GPU with fivedc's own option builder (at the
plan level: every pass but the agreement proof). The measured figure is the paper's;
the predicted one is fivedc's; nothing is fitted to either (the hardware profile is
`fivedc/ir/hardware.toml`'s, the same for every row).

Sources (read from the papers, never from fivedc's output):

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (SC'21, arXiv 2104.04473), table 1: GPT models 1.7B to 1T on
  A100 80GB (Selene: DGX A100 nodes of 8, 8 x 200 Gb/s HDR per node), sequence 2048,
  vocabulary 51200, full recomputation, mixed precision. The paper gives achieved
  TFLOP/s per GPU counting its formula's FLOPs, 96 B s l h^2 (1 + s/6h + V/16lh)
  (recomputation included, section 5.1), so measured seconds = that / (GPUs x TFLOP/s).
  Micro-batch sizes, data-parallel flavour and virtual stages: Megatron-LM's
  `examples/sc21/run_table_1.sh` (the paper's own scripts).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys 2023, arXiv 2205.05198), table 3 (22B, 175B, 530B, 1T: tensor 8,
  pipeline 1/8/35/64, 8/64/280/512 A100 80GB, global batch 4/64/280/512, sequence 2048)
  and table 5 (iteration seconds with full recomputation, and with sequence parallelism
  plus selective recomputation), and table 2 (activation bytes per layer by technique:
  s b h (34 + 5 a s / h) with no parallelism, (10 + 24/t + 5as/ht) tensor parallel,
  (34/t + 5as/ht) with sequence parallel, (10 + 24/t) selective, 34/t both, 2 full).

Held out (other teams, systems and GPUs, each row's source in its constructor below):
Smith et al. 2022 (MT-NLG 530B, DeepSpeed on A100s), BigScience 2022 (BLOOM 176B,
Megatron-DeepSpeed on 384 A100s: the run's launch script and its logged iteration time in
bigscience-workshop/bigscience train/tr11-176B-ml), Dubey et al. 2024 (Llama 3 405B on
H100s), torchtitan's docs/performance.md at commit 0413364 (FSDP2 on 64 A100s: Llama 3 70B,
Llama 2 13B and 70B) and its benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (Llama 3
70B, FSDP2 + async TP on 256 H100s). FP8 rows, printed apart: DeepSeek-AI 2024 (DeepSeek-V3
on 2048 H800s), torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (the TorchTitan
paper's tables, Liang et al. 2024, arXiv 2410.06511: Llama 3.1 8B, 70B and 405B on 8 to
512 H100s with FSDP2, TP, PP and CP, float8) and the float8 row of its async TP page.

    python benchmarks/validation.py             # the table (about a minute on 2 cores)
    python benchmarks/validation.py --write     # also replaces the table in benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from results_block import replace_block  # beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- validation:begin -->", "<!-- validation:end -->"
GPT = ROOT / "examples" / "gpt3_175b.5d"  # Megatron's GPT: the shape is each row's
SEQ, VOCAB = 2048, 51200
# What both papers' Megatron-LM ran, besides the layout: attention by separate kernels
# (q k^T, the fused scale-mask-softmax, p v: the scores materialised; flash attention
# came later) and tensor parallelism's collectives blocking, not beside the matmuls.
# --no-overlap also leaves the gradient all-reduce after backward: what Megatron's
# "local" DDP did (every row with a pipeline); the rows without one ran torch's DDP,
# which overlaps it (there it is 1-3 % of the step, counted whole here).
MEGATRON = "--attention-kernel math --no-overlap"
NARAYANAN = "Narayanan et al. 2021, table 1"
KORTHIKANTI = "Korthikanti et al. 2022, table 5"


@dataclass(frozen=True, slots=True)
class Run:
    """One published run: the model at its shape, its layout, and what was measured."""

    key: str
    source: str
    shape: tuple[tuple[str, int], ...]  # the model's dims as the run had them
    mesh: str  # DPxPPxTPxCPxEP
    micro: int  # sequences per microbatch
    flags: str  # fivedc compile flags beyond the mesh and the microbatches
    measured_s: float | None = None  # seconds per step as the source gives it, or as its TFLOP/s mean
    measured_mfu: float | None = None  # or the model FLOPs utilisation it gives
    model: Path = GPT
    gpu: str = "a100"
    held_out: bool = False  # not one of issue 35's two tables: the model's generalisation
    measured_gib: float | None = None  # the busiest GPU's memory as the source gives it

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.shape)

    @property
    def gpus(self) -> int:
        return math.prod(int(n) for n in self.mesh.split("x"))

    @property
    def microbatches(self) -> int:
        dp, _, _, _, ep = (int(n) for n in self.mesh.split("x"))  # dp and ep both split the batch
        return self.dims["batch"] // (dp * ep * self.micro)

    def argv(self) -> list[str]:
        # without a pipeline fivedc runs a rank's sequences as one batch (18B's 4 accumulated
        # microbatches of 8 as one of 32: the same FLOPs and traffic, once per step)
        more = ["--microbatches", str(self.microbatches)] if self.mesh.split("x")[1] != "1" else []
        return ["compile", f"{self.key}.5d", "--mesh", self.mesh, *more, *self.flags.split(), "--gpu", self.gpu]

    def command(self) -> str:
        return "fivedc " + " ".join(self.argv())


def narayanan_seconds(layers: int, hidden: int, batch: int, gpus: int, tflops: float) -> float:
    """The step that table 1's TFLOP/s per GPU means, by the paper's own FLOP count."""
    s, h, V = SEQ, hidden, VOCAB
    flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
    return flops / (gpus * tflops * 1e12)


def _gpt(layers: int, hidden: int, heads: int, batch: int) -> tuple[tuple[str, int], ...]:
    return (("batch", batch), ("seq", SEQ), ("hidden", hidden), ("heads", heads), ("vocab", VOCAB),
            ("layers", layers))


def _narayanan(key, layers, hidden, heads, tp, pp, gpus, batch, micro, virtual, tflops) -> Run:
    schedule = "" if pp == 1 else (f"--schedule interleaved --virtual {virtual}" if virtual > 1 else "--schedule 1f1b")
    return Run(f"gpt-{key}", NARAYANAN, _gpt(layers, hidden, heads, batch), f"{gpus // (tp * pp)}x{pp}x{tp}x1x1",
               micro, f"{schedule} --recompute full {MEGATRON}".strip(),
               narayanan_seconds(layers, hidden, batch, gpus, tflops))


def _korthikanti(key, layers, hidden, heads, pp, gpus, batch, micro, full, present) -> tuple[Run, Run]:
    schedule = "--schedule 1f1b " if pp > 1 else ""
    return tuple(Run(f"{key}-{mode}", KORTHIKANTI, _gpt(layers, hidden, heads, batch), f"{gpus // (8 * pp)}x{pp}x8x1x1",
                     micro, f"{schedule}{flags} {MEGATRON}", seconds)
                 for mode, flags, seconds in (("full", "--recompute full", full),
                                              ("sp-selective", "--sp --recompute selective", present)))


def _mt_nlg(nodes: int, seconds: float) -> Run:
    """MT-NLG 530B (Smith et al. 2022, arXiv 2201.11990, section 2.4 and table of
    throughput): 105 layers, hidden 20480, 128 heads, sequence 2048, tensor 8 x pipeline 35
    on DGX A100 nodes (8 x A100 80GB), global batch 1920, microbatch 1, DeepSpeed's 1F1B
    pipeline, activation checkpointing, ZeRO-1; 60.1 / 50.2 / 44.4 s per iteration on
    280 / 350 / 420 nodes. Megatron's attention and blocking TP, as above."""
    shape = (("batch", 1920), ("seq", SEQ), ("hidden", 20480), ("heads", 128), ("vocab", VOCAB), ("layers", 105))
    return Run(f"mt-nlg-{nodes}n", "Smith et al. 2022, section 2.4", shape, f"{nodes * 8 // 280}x35x8x1x1", 1,
               f"--schedule 1f1b --zero 1 --recompute full {MEGATRON}", seconds, held_out=True)


def _bloom() -> Run:
    """BLOOM 176B (BigScience 2022, arXiv 2211.05100, section 3.4: 384 A100 80GB on Jean
    Zay, 48 nodes of 8; Megatron-DeepSpeed, tensor 4 x pipeline 12 x data 8, ZeRO stage 1,
    bf16), at the layout of the run's own launch script, bigscience-workshop/bigscience
    train/tr11-176B-ml/tr11-176B-ml.slurm (commit 003b250): 70 layers, hidden 14336, 112
    heads, sequence 2048, vocabulary padded to 250880, TP_SIZE=4, PP_SIZE=12, micro-batch
    2 ("was MBS=1 till GBS=784"), global batch 2048, --checkpoint-activations (full),
    DeepSpeed ZERO_STAGE=0 "bf16 must use z0! it implements its own zero stage 1
    equivalent" (DeepSpeed's bf16 optimizer shards the optimizer state: ZeRO-1 here),
    DeepSpeed's 1F1B pipeline, gradients reduced after the microbatches. Measured: the
    log line quoted in the same folder's chronicles.md (commit e726b15), iteration 12695
    at global batch 2048 (ramp-up over): "elapsed time per iteration (s): 105.22 ...
    TFLOPs: 149.02". Megatron's GPT stands for BLOOM (examples/gpt3_175b.5d at its shape,
    tied output as BLOOM's): BLOOM's ALiBi bias on the scores and its embedding
    LayerNorm are not in it, and its learned positions (2048 x 14336) are; Megatron's
    attention (scores materialised, fused softmax) and blocking TP, as above. Jean Zay's
    nodes have 4 x 100 Gb/s Omni-Path each (the paper's section 3.4), a quarter of the a100
    profile's per-GPU bandwidth: the a100-opa profile (fivedc/ir/hardware.toml). The launch
    script also sets CUDA_LAUNCH_BLOCKING=1, which is not priced."""
    shape = (("batch", 2048), ("seq", SEQ), ("hidden", 14336), ("heads", 112), ("vocab", 250880), ("layers", 70))
    return Run("bloom-176b-384", "BigScience 2022, tr11-176B-ml chronicles.md", shape, "8x12x4x1x1", 2,
               f"--schedule 1f1b --zero 1 --recompute full {MEGATRON}", 105.22, gpu="a100-opa", held_out=True)


def _llama3(gpus: int, mesh: str, seq: int, mfu: float) -> Run:
    """Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4 and section
    3.3.2): BF16 MFU of the pre-training runs on H100s, 16M tokens a step; tensor 8 (SP),
    pipeline 16 interleaved (microbatch 1: a microbatch per sequence of a data-parallel
    rank), context 16 at 128K by all-gathering K and V, FSDP keeping the gathered
    parameters through the step (ZeRO-2 here); flash attention and overlapped TP as
    fivedc's defaults."""
    cp = "--cp-attention allgather " if mesh.split("x")[3] != "1" else ""
    return Run(f"llama3-405b-{gpus}-{seq // 1024}k", "Dubey et al. 2024, table 4",
               (("batch", 2**24 // seq), ("seq", seq)), mesh, 1,
               f"--sp {cp}--zero 2 --schedule interleaved", measured_mfu=mfu,
               model=ROOT / "examples" / "llama3_405b.5d", gpu="h100", held_out=True)


TORCHTITAN = "torchtitan docs/performance.md (commit 0413364)"
LLAMA = ROOT / "examples" / "llama3_405b.5d"  # Llama's layers: the shape is each row's


def _torchtitan(key: str, shape: tuple[tuple[str, int], ...], seq: int, local: int, recompute: str,
                tokens_per_gpu_s: float) -> Run:
    """torchtitan's FSDP2 on 64 A100 80GB (its docs/performance.md at commit 0413364, the
    tables of Llama 3 and Llama 2): every parameter sharded over the 64 (ZeRO-3), `local`
    sequences a GPU, SDPA's flash backend (FlashAttention-2: `--attention-kernel flash2`, on an
    A100 priced as flash), no torch.compile, bf16; the measured figure is
    its words (tokens) per second per GPU, so a step is local x seq / that. Only the rows
    without checkpointing or with full: its "selective op" rows recompute every second
    matmul of a layer and its "selective layer" ones every second layer, which no fivedc
    recomputation mode does (`selective` rebuilds attention's core), so they are left out."""
    dims = (("batch", 64 * local), ("seq", seq), *shape)
    flags = "--zero 3" + (f" --recompute {recompute}" if recompute != "none" else "") + " --attention-kernel flash2"
    return Run(key, TORCHTITAN, dims, "64x1x1x1x1", local, flags, local * seq / tokens_per_gpu_s, model=LLAMA,
               held_out=True)


# Llama 3 70B (The Llama 3 Herd of Models, table 3), Llama 2 13B and 70B (Touvron et
# al. 2023, table 1 and its released configs): the dims the Llama example's text has.
LLAMA3_70B = (("hidden", 8192), ("heads", 64), ("kv_heads", 8), ("ffn", 28672), ("layers", 80))
LLAMA2_13B = (("hidden", 5120), ("heads", 40), ("kv_heads", 40), ("ffn", 13824), ("vocab", 32000), ("layers", 40))
LLAMA2_70B = (("hidden", 8192), ("heads", 64), ("kv_heads", 8), ("ffn", 28672), ("vocab", 32000), ("layers", 80))

LLAMA31_8B = (("hidden", 4096), ("heads", 32), ("kv_heads", 8), ("ffn", 14336), ("layers", 32))
# Llama 3.1 8B in torchtitan's own model args (torchtitan/models/llama/__init__.py at commit
# 9dec370: dim 4096, 32 layers, 32 heads, 8 kv heads, ffn_dim_multiplier 1.3 and multiple_of
# 1024, so an FFN of 14336; its tiktoken vocabulary of 128000 + 256 reserved = 128256);
# its 70B and 405B args give the dims of LLAMA3_70B and the Llama example.
TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"


def _titan_h100(key: str, source: str, shape: tuple[tuple[str, int], ...], mesh: str, seq: int, local: int,
                tokens_per_gpu_s: float, fp8: bool, schedule: str = "", gib: float | None = None) -> Run:
    """torchtitan on H100s (Meta's Grand Teton: 8 H100 96GB HBM2e at 500 W a host, NVLink
    inside, 400 Gb/s RDMA a GPU: the h100-gt profile, whose peak is the die's at 500 W between
    the NVL's and the SXM's, fivedc/ir/hardware.toml), from its two H100 benchmark pages:
    `llama3_h100_202412_torchtitan.md` (the December 2024 runs at torchtitan 9dec370, torch 1963fc8, first
    published as docs/performance.md at commit d4c86e3, the tables of the TorchTitan paper,
    Liang et al. 2024, arXiv 2410.06511) and `asyncTP_llama3_h100_2025-06_torchtitan.md`
    (June 2025, torchtitan 820504e). Where a table gives no sequence length, it is the
    train configs' seq_len = 8192 at those commits (llama3_70b.toml, llama3_405b.toml).
    Every row: FSDP2 over the data-parallel ranks (ZeRO-3; under a pipeline torchtitan
    does not reshard after forward, parallelize_llama.py at 9dec370, so the parameters
    stay gathered: ZeRO-2 here, as the Llama 3 rows),
    torch.compile, full activation checkpointing, attention by SDPA's flash backend,
    FlashAttention-2 (`--attention-kernel flash2`: under cp torchtitan pinned SDPA to its flash
    and memory-efficient backends, utils.py get_train_context at 9dec370; otherwise SDPA's
    default, in which cuDNN's kernel came last since pytorch PR #138522, October 2024), async TP where
    there is TP (its tensor parallel plan is sequence parallel: SequenceParallel on the
    norms), context parallelism by all-gathering K and V (config_manager.py's default
    rotate method at 9dec370), load-balanced. `local` is the sequences of a data-parallel
    rank, and the measured figure its tokens per second per GPU, which torchtitan counts
    as a rank's tokens over the step time x cp x tp x pp (train.py at 9dec370,
    components/metrics.py at 820504e), so a step is local x seq / (that x cp x tp x pp).
    A pipeline runs torchtitan's default microbatches, as many as pipeline ranks
    (pipelining_utils.py at 9dec370), and its interleaved schedule two stages a rank (the
    same file's generated split points). float8 rows are torchao's tensorwise recipe on
    the linears (with float8 FSDP all-gathers, which fivedc does not price), the recipe
    `--fp8` prices; torch.compile's fusions are not priced either. `gib`: the table's
    Memory(GiB), torchtitan's largest reading over the GPUs of the caching allocator's
    reserved peak (`max_reserved_gib`, components/metrics.py), its free cached blocks included."""
    dp, pp, tp, cp, _ = (int(n) for n in mesh.split("x"))
    micro = local // pp if pp > 1 else local
    flags = ((f"{schedule} " if schedule else "") + ("--sp " if tp > 1 else "")
             + ("--cp-attention allgather " if cp > 1 else "")
             + f"--zero {2 if pp > 1 else 3} --recompute full --attention-kernel flash2" + (" --fp8" if fp8 else ""))
    return Run(key, source, (("batch", dp * local), ("seq", seq), *shape), mesh, micro, flags,
               local * seq / (tokens_per_gpu_s * cp * tp * pp), model=LLAMA, gpu="h100-gt", held_out=True,
               measured_gib=gib)


def _deepseek_v3() -> Run:
    """DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437,
    section 1 and table 1: "180K H800 GPU hours" per trillion training tokens; section 3:
    2048 H800s, 16-way pipeline by DualPipe, 64-way expert parallelism over 8 nodes, ZeRO-1
    data parallelism, no tensor parallelism, FP8 mixed precision; section 4.2: batch 15360
    sequences of 4096 tokens). The step a GPU-hour figure means: tokens per step / (GPUs x
    tokens per GPU-second). fivedc's `--fp8` is torchao's tensorwise recipe on the linears,
    not DeepSeek's block-scaled FP8 that also covers the experts' GEMMs (there: bf16), and
    full recomputation stands for DeepSeek's partial one (examples/deepseek_v3.5d)."""
    batch, seq, gpus = 15360, 4096, 2048
    tokens_per_gpu_s = 1e12 / (180e3 * 3600)
    return Run("deepseek-v3-2048", "DeepSeek-AI 2024, table 1", (("batch", batch), ("seq", seq)), "2x16x1x1x64", 1,
               "--schedule dualpipe --zero 1 --recompute full --fp8", batch * seq / (gpus * tokens_per_gpu_s),
               model=ROOT / "examples" / "deepseek_v3.5d", gpu="h800", held_out=True)


# FP8 runs: printed apart and not in `fivedc/estimates/model_error.py` (the bf16 runs above):
# DeepSeek-V3 ran a recipe fivedc does not price (`--fp8`, passes/fp8.py: torchao's
# tensorwise recipe on the linears); torchtitan's rows ran that recipe, but with float8
# FSDP all-gathers and torch.compile, neither priced.
FP8_RUNS = (
    _deepseek_v3(),
    # torchtitan's December 2024 H100 tables (TorchTitan paper): table 2, Llama 3.1 8B on 8
    # GPUs, FSDP x CP, local batch 1, float8; table 4, 70B on 256 (FSDP 32, TP 8), local
    # batch 16, float8 + async TP; table 5, 405B on 512 (FSDP 8, TP 8, PP 8), local batch 32,
    # float8 + async TP, by schedule; table 6, 405B on 512 (TP 8, PP 8, FSDP x CP 8), 1F1B,
    # local batch 8, float8 + async TP.
    _titan_h100("titan-h100-8b-32k", TITAN_H100, LLAMA31_8B, "8x1x1x1x1", 32768, 1, 3890, True, gib=83.9),
    _titan_h100("titan-h100-8b-64k-cp2", TITAN_H100, LLAMA31_8B, "4x1x1x2x1", 65536, 1, 2540, True, gib=84.2),
    _titan_h100("titan-h100-8b-128k-cp4", TITAN_H100, LLAMA31_8B, "2x1x1x4x1", 131072, 1, 1071, True, gib=84.0),
    _titan_h100("titan-h100-8b-256k-cp8", TITAN_H100, LLAMA31_8B, "1x1x1x8x1", 262144, 1, 548, True, gib=84.5),
    _titan_h100("titan-h100-70b-2d", TITAN_H100, LLAMA3_70B, "32x1x8x1x1", 8192, 16, 876, True, gib=67.6),
    _titan_h100("titan-h100-405b-1f1b", TITAN_H100, (), "8x8x8x1x1", 8192, 32, 100, True,
                "--schedule 1f1b", gib=82.5),
    _titan_h100("titan-h100-405b-interleaved", TITAN_H100, (), "8x8x8x1x1", 8192, 32, 128, True,
                "--schedule interleaved --virtual 2", gib=72.7),
    _titan_h100("titan-h100-405b-32k", TITAN_H100, (), "8x8x8x1x1", 32768, 8, 76, True, "--schedule 1f1b", gib=75.3),
    _titan_h100("titan-h100-405b-64k-cp2", TITAN_H100, (), "4x8x8x2x1", 65536, 8, 47, True,
                "--schedule 1f1b", gib=75.9),
    _titan_h100("titan-h100-405b-128k-cp4", TITAN_H100, (), "2x8x8x4x1", 131072, 8, 31, True,
                "--schedule 1f1b", gib=77.1),
    _titan_h100("titan-h100-405b-256k-cp8", TITAN_H100, (), "1x8x8x8x1", 262144, 8, 16, True,
                "--schedule 1f1b", gib=84.9),
    # June 2025's async TP page: Llama 3 70B on 256 (FSDP 32, TP 8), local batch 16, float8
    # tensorwise with async TP (its bf16 row is in RUNS)
    _titan_h100("titan-asynctp-70b-fp8", TITAN_ASYNC_TP, LLAMA3_70B, "32x1x8x1x1", 8192, 16, 942.4, True),
)


# Narayanan et al. table 1: (key, layers, hidden, heads, tp, pp, GPUs, global batch,
# microbatch, chunks per pp rank, TFLOP/s per GPU), with run_table_1.sh's microbatch and
# virtual stages (layers / pp / layers-per-virtual-stage chunks per rank).
RUNS = (
    _narayanan("1.7b", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    _narayanan("3.6b", 30, 3072, 32, 2, 1, 64, 512, 16, 1, 138),
    _narayanan("7.5b", 36, 4096, 32, 4, 1, 128, 512, 16, 1, 142),
    _narayanan("18b", 40, 6144, 48, 8, 1, 256, 1024, 8, 1, 135),
    _narayanan("39b", 48, 8192, 64, 8, 2, 512, 1536, 4, 1, 138),
    _narayanan("76b", 60, 10240, 80, 8, 4, 1024, 1792, 2, 3, 140),
    _narayanan("145b", 80, 12288, 96, 8, 8, 1536, 2304, 2, 2, 148),
    _narayanan("310b", 96, 16384, 128, 8, 16, 1920, 2160, 1, 2, 155),
    _narayanan("530b", 105, 20480, 128, 8, 35, 2520, 2520, 1, 3, 163),
    _narayanan("1t", 128, 25600, 160, 8, 64, 3072, 3072, 1, 1, 163),
    # Korthikanti et al. table 3 layouts (data parallel 1, microbatch 1 under a pipeline),
    # table 5's measured iteration seconds: full recomputation, then SP + selective.
    *_korthikanti("22b", 48, 6144, 64, 1, 8, 4, 4, 1.42, 1.10),
    *_korthikanti("175b", 96, 12288, 96, 8, 64, 64, 1, 18.13, 13.75),
    *_korthikanti("530b", 105, 20480, 128, 35, 280, 280, 1, 49.05, 37.83),
    *_korthikanti("1t", 128, 25600, 160, 64, 512, 512, 1, 94.42, 71.49),
    # held out: runs of other teams, other systems and other GPUs
    _mt_nlg(280, 60.1), _mt_nlg(350, 50.2), _mt_nlg(420, 44.4),
    _bloom(),
    _llama3(8192, "64x16x8x1x1", 8192, 0.43),
    _llama3(16384, "128x16x8x1x1", 8192, 0.41),
    _llama3(16384, "8x16x8x16x1", 131072, 0.38),
    _torchtitan("titan-llama3-70b", LLAMA3_70B, 8192, 1, "full", 331),
    _torchtitan("titan-llama2-13b", LLAMA2_13B, 4096, 2, "none", 2162),
    _torchtitan("titan-llama2-70b", LLAMA2_70B, 4096, 2, "full", 353),
    # torchtitan's June 2025 async TP page: Llama 3 70B on 256 H100s (FSDP 32, TP 8),
    # local batch 16, bf16 with async TP
    _titan_h100("titan-asynctp-70b", TITAN_ASYNC_TP, LLAMA3_70B, "32x1x8x1x1", 8192, 16, 652.4, False),
)


def measured_seconds(run: Run, graph) -> float:
    """The run's step: as the source gives it, or from its MFU by PaLM's FLOP count
    (Chowdhery et al. 2022, appendix B: 6 N + 12 L H Q T per token, N the parameters)."""
    if run.measured_s is not None:
        return run.measured_s
    from fivedc.ir.graph import param_instances
    from fivedc.ir.hardware import hardware

    params = sum(math.prod(graph.dim(d) for d in p.dims) for _, p in param_instances(graph))
    seq, layers, hidden = graph.dim("seq"), graph.dim("layers"), graph.dim("hidden")
    flops = graph.dim("batch") * seq * (6 * params + 12 * layers * hidden * seq)
    return flops / (run.gpus * run.measured_mfu * hardware(run.gpu).bf16_flops)


def model_text(run: Run) -> str:
    """The run's model (Megatron's GPT, examples/gpt3_175b.5d, or an example) at its shape."""
    text = run.model.read_text()
    for name, value in run.shape:
        text, n = re.subn(rf"(?m)^(\s+{name} = )\S+", rf"\g<1>{value}", text, count=1)
        if n != 1:
            raise SystemExit(f"{run.model} has no dim {name} to set")
    return text


def compile_run(run: Run, peaks: tuple[float, float] | None = None):
    """The run's plan (every pass but the agreement proof), with `fivedc compile`'s options;
    `peaks` (bf16, float8 FLOP/s) in place of its profile's."""
    from dataclasses import replace

    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_options
    from fivedc.frontends.dsl_file import parse_model
    from fivedc.ir.mesh import Mesh
    from fivedc.pipeline import PIPELINE, run_passes
    from fivedc.plan.planning import Draft, assemble

    args = build_parser().parse_args(run.argv())
    options = compile_options(args, Mesh.parse(args.mesh, rank_order=args.rank_order), dtype=args.dtype)
    if peaks is not None:
        options = replace(options, hardware=replace(options.hardware, bf16_flops=peaks[0], fp8_flops=peaks[1]))
    graph = parse_model(model_text(run), filename=f"{run.key}.5d")
    return assemble(run_passes(Draft(graph), options, PIPELINE[:-1]), options)


@dataclass(frozen=True, slots=True)
class Row:
    run: Run
    measured_s: float
    predicted_s: float
    predicted_gib: float = 0.0  # the busiest class of ranks' total (`plan.memory.busiest`)

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s


def row(run: Run) -> Row:
    plan = compile_run(run)
    return Row(run, measured_seconds(run, plan.graph), plan.time.step_seconds, plan.memory.busiest.total / 2**30)


# The peak of the h100-gt profile (Meta's H100s at 500 W) is derived: torchtitan gives it only
# as "between SXM and NVL". The held-out figures at either bound, from the data sheets (dense
# bf16 and float8, the "with sparsity" figures halved): H100 NVL 1,671 and 3,341 TFLOPS,
# H100 SXM 1,979 and 3,958.
PEAK_BOUNDS = (("the H100 NVL's", (835.5e12, 1670.5e12)), ("the H100 SXM's", (989.4e12, 1979e12)))


def peak_bounds(found: list[Row]) -> list[str]:
    """The held-out median with the h100-gt rows at each bound of their GPU's peak."""
    held = [r for r in found if r.run.held_out]
    derived = [r for r in held if r.run.gpu == "h100-gt"]
    lines = []
    for name, peaks in PEAK_BOUNDS if derived else ():
        again = {r.run.key: Row(r.run, r.measured_s, compile_run(r.run, peaks).time.step_seconds) for r in derived}
        ratios = [again.get(r.run.key, r).ratio for r in held]
        lines += [f"- Held out with h100-gt at {name} peak ({peaks[0] / 1e12:.1f} TFLOP/s): median "
                  f"{statistics.median(ratios):.2f};",
                  "  " + ", ".join(f"{k} {r.ratio:.2f}" for k, r in again.items()) + "."]
    return lines


def rows(only: tuple[str, ...] = ()) -> list[Row]:
    return [row(run) for run in RUNS if not only or run.key in only]


def speedups(found: list[Row]) -> list[tuple[str, float, float]]:
    """Korthikanti's SP + selective over full recomputation: (model, predicted, measured)."""
    by = {r.run.key: r for r in found}
    out = []
    for key in by:
        if key.endswith("-full") and key.replace("-full", "-sp-selective") in by:
            full, present = by[key], by[key.replace("-full", "-sp-selective")]
            out.append((key[:-5], full.predicted_s / present.predicted_s, full.measured_s / present.measured_s))
    return out


# Korthikanti et al. table 2: activation bytes per layer over s b h, by technique, less the
# dropout terms (Megatron's GPT has three dropouts, fivedc's none: the attention's mask
# and output, a s^2 b x 3 bytes, and two masks of s b h bytes), as the paper's section
# 4.1 itemises them: t the tensor-parallel size, r = a s / h.
ACTIVATION_FORMULAS = (
    ("tensor parallel", "", "none", lambda t, r: 8 + 24 / t + 2 * r / t),
    ("+ sequence parallel", "--sp", "none", lambda t, r: 32 / t + 2 * r / t),
    ("tensor parallel + selective", "", "selective", lambda t, r: 8 + 24 / t),
    ("+ sequence parallel + selective", "--sp", "selective", lambda t, r: 32 / t),
    ("full recomputation", "", "full", lambda t, r: 2),
)


def activation_rows(key: str = "22b-full") -> list[tuple[str, float, float]]:
    """(technique, fivedc's bytes per layer, the paper's) for one sequence of a Korthikanti
    run's model at tp 8: what one layer keeps for backward (`layer_saves`)."""
    from dataclasses import replace

    from fivedc.estimates.activations import layer_saves
    from fivedc.estimates.saved import SaveContext
    from fivedc.ir.graph import Repeat

    base = next(r for r in RUNS if r.key == key)
    tp = int(base.mesh.split("x")[2])
    out = []
    for name, sp, mode, formula in ACTIVATION_FORMULAS:
        run = replace(base, shape=tuple((k, 1 if k == "batch" else v) for k, v in base.shape),
                      mesh=f"1x1x{tp}x1x1", micro=1, flags=f"{sp} --recompute {mode} {MEGATRON}")
        plan = compile_run(run)
        c = SaveContext.of(plan.graph, plan.mesh, dtype=plan.dtype, dtype_bytes=2, recompute=mode)
        repeat = next(item for item in plan.graph.body.items if isinstance(item, Repeat))
        saves = layer_saves(c, repeat)
        predicted = saves.own + sum(b for _, b in saves.args)
        h, a = run.dims["hidden"], run.dims["heads"]
        out.append((name, predicted, SEQ * h * formula(tp, a * SEQ / h)))
    return out


def activation_table(found: list[tuple[str, float, float]]) -> str:
    lines = ["| technique (22B, tp 8, one sequence) | fivedc MiB per layer | paper MiB | fivedc / paper |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {ours / 2**20:.1f} | {paper / 2**20:.1f} | {ours / paper:.2f} |"
              for name, ours, paper in found]
    return "\n".join(lines)


def summary(found: list[Row]) -> tuple[int, float, float, float]:
    """(runs, median, lowest, highest) of predicted / measured."""
    ratios = [r.ratio for r in found]
    return len(ratios), statistics.median(ratios), min(ratios), max(ratios)


def table(found: list[Row]) -> str:
    lines = ["| run (source) | layout: `fivedc compile` flags | GPU | measured s | predicted s | predicted / measured |",
             "|---|---|---|---:|---:|---:|"]
    for r in found:
        flags = " ".join(r.run.argv()[3:-2]).replace(MEGATRON, "(Megatron)")
        lines.append(f"| {r.run.key} ({r.run.source}) | `{flags}` | {r.run.gpu} | {r.measured_s:.3g} | "
                     f"{r.predicted_s:.3g} | {r.ratio:.2f} |")
    lines += ["", f"(Megatron) stands for `{MEGATRON}`.", ""]
    for title, group in (("issue 35's two tables", [r for r in found if not r.run.held_out]),
                         ("held out (other teams, systems and GPUs)", [r for r in found if r.run.held_out])):
        if group:
            n, median, low, high = summary(group)
            lines.append(f"- Step time, predicted / measured, {title}: {n} runs, median {median:.2f}, "
                         f"range {low:.2f}-{high:.2f}.")
    lines += peak_bounds(found)
    if found:
        lines.append("- `fivedc/estimates/model_error.py` holds the figures of all runs for `fivedc search`: "
                     "{} runs, median {:.2f}, range {:.2f}-{:.2f}.".format(*summary(found)))
    for model, predicted, measured in speedups(found):
        lines.append(f"- {model}: SP + selective over full recomputation, predicted {predicted:.2f}x, "
                     f"measured {measured:.2f}x")
    return "\n".join(lines)


def fp8_table(found: list[Row]) -> str:
    """The FP8 runs, apart: predicted / measured with what fivedc's recipe leaves out."""
    lines = ["FP8 runs (held out, not in the model's error: fivedc's `--fp8` is torchao's tensorwise recipe on "
             "linears; DeepSeek-V3 ran its own block-scaled recipe, experts included; torchtitan's rows ran "
             "torchao's tensorwise recipe with float8 FSDP all-gathers and torch.compile):", "",
             "| run (source) | layout: `fivedc compile` flags | GPU | measured s | predicted s | predicted / measured |",
             "|---|---|---|---:|---:|---:|"]
    for r in found:
        flags = " ".join(r.run.argv()[3:-2])
        lines.append(f"| {r.run.key} ({r.run.source}) | `{flags}` | {r.run.gpu} | {r.measured_s:.3g} | "
                     f"{r.predicted_s:.3g} | {r.ratio:.2f} |")
    return "\n".join(lines) if found else ""


def memory_table(found: list[Row]) -> str:
    """The runs whose source gives the busiest GPU's memory: fivedc's busiest rank against it."""
    found = [r for r in found if r.run.measured_gib is not None]
    if not found:
        return ""
    lines = ["Memory of the busiest GPU, where the source gives it (torchtitan: the caching allocator's",
             "reserved peak, free cached blocks included; fivedc: the busiest rank's tensors, its",
             "profile's reserved_gib apart):", "",
             "| run | GPU | measured GiB | predicted GiB | predicted / measured |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r.run.key} | {r.run.gpu} | {r.run.measured_gib:.1f} | {r.predicted_gib:.1f} | "
              f"{r.predicted_gib / r.run.measured_gib:.2f} |" for r in found]
    ratios = [r.predicted_gib / r.run.measured_gib for r in found]
    lines += ["", f"- Memory, predicted / measured: {len(ratios)} runs, median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {RESULTS.name}")
    parser.add_argument("--only", default="", help="comma-separated run keys")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    only = tuple(k for k in args.only.split(",") if k)
    unknown = sorted(set(only) - {run.key for run in (*RUNS, *FP8_RUNS)})
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such run (the keys are the table's first column)")
    if only and args.write:
        parser.error(f"--write replaces the whole table in {RESULTS.name}: drop --only")
    fp8 = [row(run) for run in FP8_RUNS if not only or run.key in only]
    text = "\n\n".join(part for part in (table(rows(only)), fp8_table(fp8), memory_table(fp8),
                                          activation_table(activation_rows())) if part)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.write:
        replace_block(RESULTS, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
