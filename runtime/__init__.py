"""The runtime: executes an execution plan with torch.distributed (gloo on CPU, NCCL on GPUs).

Layer 8: may import the frontends, the plan and everything below; never the CLI
(`fivedc.cli`) or `fivedc.parallel`.
"""

DEFAULT_TIMEOUT_S = 300.0  # how long a rank waits in a collective for its peers
