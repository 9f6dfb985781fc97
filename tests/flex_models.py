"""Models for tests/test_flex_attention.py, in a file of their own (workers load the factories by
`file.py:factory` spec): examples/llama.py with its attention computed by torch's FlexAttention
as torchtitan calls it, `torch.compile(flex_attention)` over a block mask made by
`torch.compile(create_block_mask)` from a document mask that closes over a tensor (each
token's document start, computed from positions that restart at every document)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402  examples/llama.py


@functools.cache
def compiled() -> tuple:
    """`torch.compile`d flex_attention and create_block_mask, as torchtitan compiles them, once;
    made at the first forward, so the ranks (which never run the module's forward) do not
    start the compiler."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


class FlexAttention(llama.Attention):
    """`document` tokens per document (None: the whole row is one), causal within each;
    `score_mod`: flex attention's score modifier, if any."""

    document: int | None = None
    window: int | None = None  # a sliding window of that many keys, the query's own among them
    score_mod = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.rope(self.wq(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(s, device=x.device).expand_as(x[..., 0])  # the inputs' shape, not values
        if self.document is not None:
            positions = positions % self.document
        starts = torch.arange(s, device=x.device) - positions  # each token's document start

        window = self.window

        def document_mask(batch, head, q_idx, kv_idx):
            seen = (kv_idx <= q_idx) & (kv_idx >= starts[batch, q_idx])
            return seen if window is None else seen & (kv_idx > q_idx - window)

        flex, block_mask_of = compiled()
        block_mask = block_mask_of(document_mask, b, None, s, s, device=x.device)
        out = flex(q, k, v, score_mod=self.score_mod, block_mask=block_mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _softcap(score, batch, head, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _factory(attention: type[FlexAttention]):
    class Block(llama.TransformerBlock):
        def __init__(self, args: llama.ModelArgs) -> None:
            super().__init__(args)
            self.attention = attention(args)

    class Model(llama.Transformer):
        block = Block

    def build(seed: int = 0):
        return llama.factory(seed=seed, args=llama.ModelArgs(), model_class=Model)

    return build


flex_causal = _factory(FlexAttention)
flex_documents = _factory(type("TwoDocuments", (FlexAttention,), {"document": 4}))
flex_softcap = _factory(type("Softcapped", (FlexAttention,), {"score_mod": staticmethod(_softcap)}))
flex_window = _factory(type("SlidingWindow", (FlexAttention,), {"window": 3}))
