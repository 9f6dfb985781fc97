"""Seconds of an attention whose scores are materialised (the `math` kernel), kernel by kernel.

With E score elements on the rank (batch x heads x sq x sk for one microbatch: the
whole square, since the masked half is computed and then masked), head dim d and
b bytes per element, each kernel is a roofline of its own (the larger of its FLOPs at
the matmul share of peak and its traffic at the memory share of HBM bandwidth):

    forward   S = q k^T        2 E d FLOPs, writes S            (E b)
              P = softmax(S)   reads S, writes P                (2 E b)
              O = P v          2 E d FLOPs, reads P             (E b)
    backward  dP = dO v^T      2 E d FLOPs, writes dP           (E b)
              dS               reads P and dP, writes dS        (3 E b)
              dv = P^T dO      2 E d FLOPs, reads P             (E b)
              dq = dS k, dk = dS^T q   2 x (2 E d FLOPs, reads dS (E b))

With d = 128 each product is near the ridge of a GPU's roofline (2d FLOPs per 2
bytes), so the traffic of the scores matters as much as their FLOPs: at sequence
2048 the math kernel costs several times the fused one (Dao et al. 2022, figure 1).
"""

from __future__ import annotations

from fivedc.ir.graph import Op
from fivedc.ir.hardware import Hardware
from fivedc.estimates.saved import SaveContext, score_elements


def math_attention_times(c: SaveContext, op: Op, hw: Hardware) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a `math` attention."""
    elements, d, b = score_elements(c, op), c.graph.dim(op.type.dims[-1]), c.dtype_bytes
    flops = 2.0 * elements * d  # one product of the scores with q, k, v or a gradient

    def kernel(flop: float, moved: float) -> float:
        return max(flop / (hw.bf16_flops * hw.matmul_efficiency), moved * elements * b / hw.op_bytes_per_s)

    forward = kernel(flops, 1) + kernel(0.0, 2) + kernel(flops, 1)
    backward = kernel(flops, 1) + kernel(0.0, 3) + kernel(flops, 1) + 2 * kernel(flops, 1)
    return forward, backward, 0.0
