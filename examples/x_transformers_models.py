"""x-transformers decoders as their users train them, tiny and randomly initialised, as fivedc factories.

`autoregressive`: the README's own language model, `TransformerWrapper(attn_layers=Decoder(...))`
under `AutoregressiveWrapper`, every setting at the library's default; `forward(x)` is the
wrapper's training loss: the next-token cross-entropy over the class dim
(`rearrange(logits, 'b n c -> b c n')`, the library's own written-out form) with
`ignore_index=-100`, which the example's padded rows use. Use it as
`fivedc compile examples/x_transformers_models.py:autoregressive --mesh ...`.

Install without moving torch (the `test` extra pins it; it depends on torch>=2.0 only):

    pip install x-transformers==2.31.10
"""

from __future__ import annotations

import torch

VOCAB, BATCH, SEQ, DIM, DEPTH, HEADS = 64, 2, 8, 32, 2, 4
IGNORE = -100  # AutoregressiveWrapper's default ignore_index
ARCHITECTURES = ("autoregressive",)


def autoregressive(*, seed: int = 0, dtype: torch.dtype = torch.float64):
    """(model, (x,)): the wrapper's loss for tokens `x`, whose last row ends in two ignored positions."""
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    torch.manual_seed(seed)
    net = TransformerWrapper(num_tokens=VOCAB, max_seq_len=2 * SEQ, attn_layers=Decoder(dim=DIM, depth=DEPTH,
                                                                                        heads=HEADS))
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    x[-1, -2:] = IGNORE  # padding: left out of the loss, read as the pad token on input
    return AutoregressiveWrapper(net).to(dtype), (x,)
