"""The runtime: executes an execution plan with torch.distributed (gloo on CPU, NCCL on GPUs)."""
