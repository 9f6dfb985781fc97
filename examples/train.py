"""Train an example model (`examples/nanogpt.py`, `llama.py` or `mixtral.py`) with fivedc under torchrun.

    torchrun --nproc-per-node 4 examples/train.py nanogpt --mesh 2x1x2x1x1 --sp
    torchrun --nproc-per-node 4 examples/train.py llama --mesh 1x1x2x2x1 --sp
    torchrun --nproc-per-node 4 examples/train.py mixtral --mesh 1x1x2x1x2
    torchrun --nproc-per-node 4 examples/train.py llama --mesh 2x2x1x1x1 --zero 1 --schedule interleaved

An ordinary training loop: `fivedc.parallelize` turns the module into this rank's
shards, and the loop is the one you would write for one GPU. Every rank builds the
same global batch (here a seeded synthetic one: each token is followed by the next
in a fixed cycle, so the loss falls) and passes all of it; the module cuts its
own shard. `loss` is the full loss on every rank; gradients are summed by the time
`backward()` returns. With `--zero` the parameters are this rank's flat chunks
(the optimizer's state with them); with pp > 1 the forward runs the pipeline
schedule and the loop stays the same. Runs on CPU (gloo) or GPU (NCCL).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fivedc
from fivedc.errors import FivedcError
from fivedc.runtime.pool import init_from_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama  # noqa: E402
import mixtral  # noqa: E402
import nanogpt  # noqa: E402

SEQ, VOCAB = 32, 128  # every model here: 32 tokens, a 128-token vocabulary
DEFAULT_MESH = {"nanogpt": "2x1x2x1x1", "llama": "1x1x2x2x1", "mixtral": "1x1x2x1x2"}


def build(name: str) -> torch.nn.Module:
    """A tiny model of the example `name`: 2 layers, hidden 64, 4 heads."""
    if name == "nanogpt":
        return nanogpt.GPT(nanogpt.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64))
    sizes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ)
    if name == "llama":
        return llama.Transformer(llama.ModelArgs(ffn_dim=192, **sizes))
    return mixtral.Transformer(mixtral.ModelArgs(**sizes))


def batch(step: int, *, batch_size: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank: random starts, then +1 mod vocab."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=DEFAULT_MESH, help="which example to train")
    parser.add_argument("--mesh", default=None, help="dp x pp x tp x cp x ep (default: see DEFAULT_MESH)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism under tp")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule, when pp > 1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plan", help="save the execution plan here (JSON; `fivedc diff` reads it)")
    parser.add_argument("--checkpoint", help="save the full (gathered) state dict here, in the module's own keys")
    args = parser.parse_args()

    info = init_from_env()
    torch.manual_seed(0)
    data = dict(batch_size=args.batch, seq=SEQ, vocab=VOCAB)
    model = fivedc.parallelize(build(args.model), mesh=args.mesh or DEFAULT_MESH[args.model],
                               sequence_parallel=args.sp, zero=args.zero, schedule=args.schedule,
                               example_inputs=batch(0, **data))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    for step in range(args.steps):
        tokens, targets = batch(step, **data)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if info.rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if args.plan and info.rank == 0:
        model.fivedc_plan.save(args.plan)
    if args.checkpoint:
        state = model.full_state_dict()  # a collective: every rank gathers
        if info.rank == 0:
            torch.save(state, args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except FivedcError as error:
        print(error.render(), file=sys.stderr)
        sys.exit(error.exit_code)
