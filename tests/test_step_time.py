"""The step-time model against published formulas: collectives, pipeline schedules, FLOPs, MFU.

Plan-level, no processes. Collective times follow the ring algorithms (2(n-1)/n for an
all-reduce, (n-1)/n for gathers) over NVLink or the network depending on where the
rank order puts the group; the schedule simulator with each chunk's seconds gives
1F1B's (m + p - 1)(F + B) and Megatron's interleaved (m v + p - 1)(F + B)/v; the model's
FLOPs are 6 x its linear parameters x tokens plus causal attention's 6·b·s²·h per
layer; Llama 3 405B at its published layout lands near its published 400 TFLOP/s
per GPU (41 % MFU).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from fivedc.cli.main import main
from fivedc.estimates.collectives import collective_seconds, node_span
from fivedc.estimates.costs import model_flops, op_times
from fivedc.estimates.gemm import Gemm, gemm_seconds
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.hardware import HardwareError, hardware, profiles
from fivedc.ir.graph import CollectiveKind as K, Op, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.estimates.saved import SaveContext
from fivedc.schedule import make_schedule, simulate
from fivedc.estimates.step_time import closed_form_makespan
from random_models import model_text

H100 = hardware("h100")


def test_profiles_are_a_data_file_users_extend(tmp_path) -> None:
    known = profiles()
    assert {"h100", "h800", "a100"} <= set(known) and known["h800"].nvlink_bytes_per_s < known["h100"].nvlink_bytes_per_s
    mine = tmp_path / "gpus.toml"
    body = "\n".join(f"{k} = {v}" for k, v in {**{f: getattr(H100, f) for f in ("bf16_flops", "hbm_bytes_per_s",
                     "memory_gib", "reserved_gib", "nvlink_bytes_per_s", "internode_bytes_per_s", "gpus_per_node",
                     "matmul_efficiency", "attention_efficiency", "memory_efficiency", "link_efficiency",
                     "nvlink_latency_s", "internode_latency_s")}, "memory_gib": 24}.items())
    mine.write_text(f'[mygpu]\nname = "small"\n{body}\n')
    assert hardware("mygpu", (mine,)).usable_bytes == int((24 - 2) * 2**30)
    mine.write_text("[broken]\nbf16_flops = 1e12\n")
    with pytest.raises(HardwareError, match="profile \\[broken\\] has no hbm_bytes_per_s"):
        hardware("h100", (mine,))
    with pytest.raises(HardwareError, match="unknown GPU 'b200'"):
        hardware("b200")


def test_collectives_run_over_nvlink_inside_a_node_and_the_network_across() -> None:
    """dp x tp = 16 x 8 with tp innermost: a tp group is one node, a dp group spans 16
    nodes with one GPU in each; with dp innermost it is the other way round."""
    mesh, b, n = Mesh.parse("16x1x8x1x1"), 2**30, 8
    assert node_span(mesh, (MeshAxis.TP,), 8) == (1, 8) and node_span(mesh, (MeshAxis.DP,), 8) == (16, 1)
    nvlink = H100.nvlink_bytes_per_s * H100.link_efficiency
    net = H100.internode_bytes_per_s * H100.link_efficiency
    assert collective_seconds(K.ALL_REDUCE, (MeshAxis.TP,), b, mesh, H100) == pytest.approx(
        2 * (n - 1) / n * b / nvlink + 2 * (n - 1) * H100.nvlink_latency_s)
    assert collective_seconds(K.ALL_GATHER, (MeshAxis.DP,), b, mesh, H100) == pytest.approx(
        15 / 16 * b / net + 15 * H100.internode_latency_s)
    flipped = Mesh.parse("16x1x8x1x1", rank_order="dp,tp,cp,ep,pp")
    assert node_span(flipped, (MeshAxis.TP,), 8) == (8, 1) and node_span(flipped, (MeshAxis.DP,), 8) == (2, 8)
    wide = Mesh.parse("8x1x2x1x1", rank_order="tp,dp,cp,ep,pp")  # dp group of rank 0: 0, 2, ..., 14
    assert node_span(wide, (MeshAxis.DP,), 8) == (2, 4)  # 2 nodes, 4 in each: 4 NICs carry it
    assert collective_seconds(K.ALL_GATHER, (MeshAxis.DP,), b, wide, H100) == pytest.approx(
        7 / 8 * b / (min(H100.nvlink_bytes_per_s, 4 * H100.internode_bytes_per_s) * H100.link_efficiency)
        + 6 * H100.nvlink_latency_s + H100.internode_latency_s)  # of the ring's 7 steps, one crosses the nodes
    # a ring hop, one GPU to the next, crosses between the nodes through one NIC: a ring's step
    # waits on that hop, whatever the other three NICs of the node carry for their own rings
    assert collective_seconds(K.SEND_RECV, (MeshAxis.DP,), b, wide, H100) == pytest.approx(
        b / net + H100.internode_latency_s)


def test_an_all_reduce_over_many_nodes_takes_nccls_tree_when_it_is_faster() -> None:
    """A ring all-reduce over 64 nodes waits on 126 network latencies; NCCL's double binary
    tree on 2 x 6 (log2 64), for twice the bytes at 0.9 of the bandwidth. A small sum takes
    the tree, a large one the ring; a profile without the tree (gloo, a TPU) the ring."""
    mesh = Mesh.parse("64x1x8x1x1")  # a dp group: one GPU in each of 64 nodes
    net = H100.internode_bytes_per_s * H100.link_efficiency
    lat = H100.internode_latency_s

    def ring(b: float) -> float:
        return 2 * 63 / 64 * b / net + 2 * 63 * lat

    def tree(b: float) -> float:
        return 2 * b / (0.9 * net) + 2 * 6 * lat

    small, large = 2**20, 2**30
    assert tree(small) < ring(small) and ring(large) < tree(large)
    for b in (small, large):
        assert collective_seconds(K.ALL_REDUCE, (MeshAxis.DP,), b, mesh, H100) == pytest.approx(min(ring(b), tree(b)))
        ringed = dataclasses.replace(H100, tree_all_reduce=False)
        assert collective_seconds(K.ALL_REDUCE, (MeshAxis.DP,), b, mesh, ringed) == pytest.approx(ring(b))
    one_node = Mesh.parse("1x1x8x1x1")  # inside a node NCCL's all-reduce is a ring
    assert collective_seconds(K.ALL_REDUCE, (MeshAxis.TP,), small, one_node, H100) == pytest.approx(
        2 * 7 / 8 * small / (H100.nvlink_bytes_per_s * H100.link_efficiency) + 2 * 7 * H100.nvlink_latency_s)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 5, 2, 1), ("1f1b", 8, 3, 1),
                                        ("interleaved", 4, 12, 3), ("interleaved", 2, 4, 2)])
def test_the_simulator_with_chunk_costs_gives_the_published_makespans(name: str, p: int, m: int, v: int) -> None:
    schedule = make_schedule(name, p, m, v if name == "interleaved" else None)
    n, forward, backward = p * schedule.v, 1.5, 3.25
    result = simulate(schedule, check=False, chunk_costs={"F": [forward / schedule.v] * n,
                                                          "B": [backward / schedule.v] * n})
    assert result.makespan == pytest.approx(closed_form_makespan(name, p, m, schedule.v, forward, backward))
    if name != "interleaved":
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    slow = simulate(schedule, check=False, chunk_costs={"F": [forward / schedule.v] * n, "B": [backward / schedule.v] * n},
                    delays={"RF": [0.1] * n, "RB": [0.1] * n})
    assert slow.makespan >= result.makespan + 2 * (p - 1) * 0.1  # the fill and drain hops at least


def gpt(layers: int = 2, size: int = 1, **options):
    text = model_text(style="gpt", batch=8, seq=64 * size, heads=8, kv_heads=8, head_dim=16 * size, ffn=512 * size,
                      vocab=256, layers=layers, causal=True)
    return compile_graph(parse_model(text, filename="m.5d"), CompileOptions(hardware=H100, **options))


def test_model_flops_are_6_n_tokens_plus_causal_attention() -> None:
    plan = gpt(mesh=Mesh.parse("1x1x2x1x1"), sequence_parallel=True)
    b, s, h, f, v, layers = 8, 64, 128, 512, 256, 2
    linear_params = layers * (4 * h * h + 2 * h * f) + h * v  # q, k, v, o; up, down; the head
    assert model_flops(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2) == pytest.approx(
        6 * linear_params * b * s + layers * 6 * b * s * s * h)
    t = plan.time
    assert t.mfu == pytest.approx(t.model_flops / (t.step_seconds * plan.mesh.world * H100.bf16_flops))
    assert t.tokens_per_second == pytest.approx(b * s / t.step_seconds)


def test_a_linear_is_a_roofline_of_its_flops_and_its_backward_twice() -> None:
    """At the flat rate (a profile without tile terms) a linear's forward is its FLOPs at the
    matmul rate and each gradient as much; on the H100's tiles each of the three GEMMs is
    priced by its own shape: rows 8 x 64 tokens, 128 in, 512 out."""
    plan = gpt(mesh=Mesh.parse("1x1x1x1x1"))
    c = SaveContext.of(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2)
    op = next(n for n, _ in walk_ops(plan.graph.body) if isinstance(n, Op) and n.kind == "linear"
              and n.args[1] == "w_up")
    flops = 2 * 8 * 64 * 128 * 512
    flat = dataclasses.replace(H100, sm_count=None, matmul_tiles=())
    forward, grad_input, grad_weight = op_times(c, op, flat)
    assert forward == pytest.approx(flops / (H100.bf16_flops * H100.matmul_efficiency))
    assert grad_input == pytest.approx(forward) and grad_weight == pytest.approx(forward)
    shaped = [gemm_seconds(Gemm(m, n, k), H100, element_bytes=2) for m, n, k in
              ((512, 512, 128), (512, 128, 512), (128, 512, 512))]
    assert op_times(c, op, H100) == pytest.approx(tuple(shaped))
    assert min(shaped) > forward  # 16 tiles on 132 SMs: far below the large-GEMM rate


def test_the_step_adds_up_and_pipelines_pay_their_bubble() -> None:
    flat = gpt(mesh=Mesh.parse("2x1x1x1x1"), zero=1).time
    assert flat.step_seconds == pytest.approx(flat.compute_seconds + flat.grad_sync_seconds + flat.zero_gather_seconds
                                              + flat.optimizer_seconds)
    piped = gpt(layers=4, size=16, mesh=Mesh.parse("1x4x1x1x1"), schedule="1f1b", microbatches=4).time
    formula = (4 - 1) / (4 + 4 - 1)  # 1F1B's bubble with equal chunks and free transfers
    assert formula <= piped.bubble < formula + 0.1  # the head and the transfers add a little
    more = gpt(layers=4, size=16, mesh=Mesh.parse("1x4x1x1x1"), schedule="1f1b", microbatches=8).time
    assert more.bubble < piped.bubble


def test_llama3_405b_at_its_published_layout_is_near_its_published_throughput() -> None:
    """Llama 3 405B trained with TP8 PP16 DP128 on 16384 H100s at about 400 TFLOP/s per
    GPU, 41 % MFU (The Llama 3 Herd of Models, table 4), with an interleaved schedule and
    its tensor-parallel communication overlapped only in part. The model at that layout,
    interleaved with 4 chunks per rank, with that communication blocking (`overlap=False`):
    within 25 % of it; with fivedc's overlap (tp's collectives beside the matmuls) faster."""
    def plan(**options):
        return compile_graph(load_model("examples/llama3_405b.5d"), CompileOptions(
            mesh=Mesh.parse("128x16x8x1x1"), sequence_parallel=True, zero=1, schedule="interleaved", virtual=4,
            hardware=H100, **options))

    blocking, overlapped = plan(overlap=False).time, plan().time
    assert blocking.tflops_per_gpu == pytest.approx(400, rel=0.25) and blocking.mfu == pytest.approx(0.41, rel=0.25)
    assert overlapped.tflops_per_gpu > blocking.tflops_per_gpu * 1.1


def test_compile_gpu_prints_fit_and_time_or_refuses_with_what_would_fit(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x2x2x1x1", "--sp", "--gpu", "h100",
                 "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Step time on NVIDIA H100 SXM5 80GB (h100)" in text and "MFU" in text and "tokens/s" in text
    assert "every class of ranks fits" in text and "bubble" in text
    data = json.loads(out.read_text())
    assert data["time"]["hardware"]["key"] == "h100" and data["time"]["step_seconds"] > 0
    assert main(["check", str(out)]) == 0  # the hardware is in the plan: it re-derives without the flag
    tiny = tmp_path / "tiny.toml"
    fields = {f: getattr(H100, f) for f in ("bf16_flops", "hbm_bytes_per_s", "nvlink_bytes_per_s",
                                            "internode_bytes_per_s", "gpus_per_node", "matmul_efficiency",
                                            "attention_efficiency", "memory_efficiency", "link_efficiency",
                                            "nvlink_latency_s", "internode_latency_s")}
    tiny.write_text("[tiny]\nmemory_gib = 0.0011\nreserved_gib = 0.0009\n" + "\n".join(f"{k} = {v}" for k, v in fields.items()))
    refused = tmp_path / "r.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x1x2x1x1", "--gpu", "tiny", "--hardware", str(tiny),
                 "-o", str(refused)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the plan does not fit on tiny: ranks all need" in err and "hint: it fits with" in err
    assert "Traceback" not in err and not refused.exists()
    # each suggested change, added to the same command, compiles and fits
    suggested = [re.sub(r"\([^)]*\)", "", s).split() for s in err.split("hint: it fits with", 1)[1].split("; or ")]
    assert len(suggested) >= 2 and all(flags and flags[0].startswith("--") for flags in suggested), suggested
    for flags in suggested:
        fits = tmp_path / "fits.json"
        assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x1x2x1x1", "--gpu", "tiny", "--hardware",
                     str(tiny), *flags, "-q", "-o", str(fits)]) == 0, (flags, " ".join(capsys.readouterr().err.split()))
        assert fits.exists()
        fits.unlink()
    capsys.readouterr()
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x1x2x1x1", "--gpu", "nosuch", "-o", str(refused)]) == 2
    assert "unknown GPU 'nosuch'" in " ".join(capsys.readouterr().err.split())


def test_llama3_405b_at_its_published_layout_fits_80gb_with_selective_recompute() -> None:
    """Acceptance: TP8 PP16 DP128 (1F1B, 16 microbatches of one sequence), SP, ZeRO-1 (Llama
    3 shards its optimizer state with FSDP), selective recomputation: every pp rank fits an
    80 GB H100 (77.6 GiB usable of 79.6)."""
    plan = compile_graph(load_model("examples/llama3_405b.5d"), CompileOptions(
        mesh=Mesh.parse("128x16x8x1x1"), sequence_parallel=True, zero=1, recompute="selective", hardware=H100))
    assert plan.memory.total <= H100.usable_bytes and len(plan.memory.ranks) > 1


def test_deepseek_v3_at_its_published_layout_fits_h800() -> None:
    """Acceptance: PP16 DualPipe (two model copies), EP64, ZeRO-1, no TP on 2048 H800s
    (dp 2 x pp 16 x ep 64), 120 microbatches of one 4096-token sequence per rank, with
    full recomputation: every pp rank fits (without it fivedc's bf16 MoE activations
    do not: benchmarks/RESULTS.md)."""
    h800 = hardware("h800")
    plan = compile_graph(load_model("examples/deepseek_v3.5d"), CompileOptions(
        mesh=Mesh.parse("2x16x1x1x64"), schedule="dualpipe", zero=1, microbatches=120, recompute="full",
        hardware=h800))
    assert plan.mesh.world == 2048 and plan.pipeline.schedule == "dualpipe"
    assert plan.memory.total <= h800.usable_bytes
