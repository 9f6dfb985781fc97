"""Models for tests/test_replicated_ops.py, in a file of their own: workers load the factories
by `file.py:factory` spec, and a test module imported again would nest its hypothesis tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402  examples/llama.py


class RunningSum(nn.Module):
    """A small LM whose block mixes the sequence with a running sum: a scan along the sequence,
    computed on shards of the batch and of the hidden dim, with the sequence whole."""

    def __init__(self, vocab: int = 32, hidden: int = 16, ffn: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + torch.cumsum(h, dim=1) * 0.25
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def running_sum(seed: int = 0):
    """The factory `fivedc verify` and the workers load: targets with -100 in uneven places."""
    torch.manual_seed(seed)
    module = RunningSum().double()
    idx = torch.randint(0, 32, (4, 8))
    targets = torch.randint(0, 32, (4, 8))
    targets[0, :5] = -100
    targets[3, 7] = -100
    return module, (idx, targets)


def _seeded(make, seed: int):
    """A RunningSum-like LM made by `make()` under `seed`, in float64, with [4, 8] tokens and targets."""
    torch.manual_seed(seed)
    return make().double(), (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))


class Flipped(RunningSum):
    """A small LM whose block adds the sequence reversed: no sharding rule (replicated)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + torch.flip(h, dims=[1]) * 0.25
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def flipped(seed: int = 0):
    torch.manual_seed(seed)
    module = Flipped().double()
    idx = torch.randint(0, 32, (4, 8))
    targets = torch.randint(0, 32, (4, 8))
    targets[1, 2:6] = -100
    return module, (idx, targets)


class LocalOps(RunningSum):
    """Ops fivedc's IR has no kind for, which torch says are pointwise or reductions: Gemma's
    RMSNorm (its weight as 1 + w), GPT-2's tanh GELU written out, a softmax over the features."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.scale)
        u = self.up(n)
        g = 0.5 * u * (1.0 + torch.tanh(0.7978845608 * (u + 0.044715 * torch.pow(u, 3.0))))
        h = h + self.down(g)
        h = h + torch.softmax(h, dim=-1) + torch.cumsum(h, dim=1) * 0.25
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def local_ops(seed: int = 0):
    torch.manual_seed(seed)
    module = LocalOps().double()
    idx = torch.randint(0, 32, (4, 8))
    return module, (idx, torch.randint(0, 32, (4, 8)))


class ShiftedLabels(RunningSum):
    """Next-token labels made inside the model as Hugging Face's loss makes them: padded with
    -100 (no rule: replicated) and sliced (along the sequence), then met with the logits. With
    causal attention, so that cp keeps the sequence in its balanced order."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        b, s, _ = h.shape
        q = self.q(h).view(b, s, 2, 8).transpose(1, 2)
        k = self.k(h).view(b, s, 2, 8).transpose(1, 2)
        v = self.v(h).view(b, s, 2, 8).transpose(1, 2)
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16))
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        labels = F.pad(idx, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


def shifted_labels(seed: int = 0):
    torch.manual_seed(seed)
    return ShiftedLabels().double(), (torch.randint(0, 32, (4, 8)),)


class InPlace(RunningSum):
    """Writes in place, as routers do (`w /= w.sum(-1, keepdim=True)`), on tensors of its own."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        g = F.gelu(self.up(h))
        g += 2.0
        g /= g.sum(-1, keepdim=True)
        g.mul_(4.0)
        h = h + self.down(g)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def in_place(seed: int = 0):
    return _seeded(InPlace, seed)


class WritesThroughAView(RunningSum):
    """Writes into a view of a tensor whose other views it reads: no pure form says the same."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        first = h[:, 0]
        first.mul_(2.0)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class TiedLM(ShiftedLabels):
    """The output projection's weight is the embedding table (tied weights, as GPT-2 and Gemma)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.emb.weight


def tied_lm(seed: int = 0):
    torch.manual_seed(seed)
    return TiedLM().double(), (torch.randint(0, 32, (4, 8)),)


class TiedTargets(TiedLM):
    """TiedLM with its targets given (no replicated label shift), so a pipeline can run it in
    microbatches; `fivedc_stage_boundary` on its head: the head's chunk reads the table again."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        b, s, _ = h.shape
        q = self.q(h).view(b, s, 2, 8).transpose(1, 2)
        k = self.k(h).view(b, s, 2, 8).transpose(1, 2)
        v = self.v(h).view(b, s, 2, 8).transpose(1, 2)
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16))
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def tied_targets(seed: int = 0):
    return _seeded(TiedTargets, seed)


class FilledSlices(RunningSum):
    """A tensor allocated, then written slice by slice (as DeepSeek-V3's `expand_kv` builds its
    keys): covering the last dim in order (`new_empty`), and part of it over zeros (`new_zeros`)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        b, s, _ = h.shape
        both = h.new_empty(b, s, 32)
        both[..., :16].copy_(h)
        both[..., 16:].copy_(torch.tanh(h[..., :1]))  # broadcast along the slice, as copy_ does
        middle = h.new_zeros(b, s, 32)
        middle[..., 8:24].copy_(h * 2.0)
        h = h + self.down(F.gelu(self.up(h)) + both + middle)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def filled_slices(seed: int = 0):
    return _seeded(FilledSlices, seed)


class Transposed(RunningSum):
    """A linear over a transposed view whose dims the IR holds in another order (the result of an
    op without a rule, viewed back as torch's [batch, seq, hidden] without .contiguous())."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        b, s, _ = h.shape
        heads = torch.flip(self.up(h).view(b, s, 4, 8).transpose(1, 2), dims=[3])  # [b, 4, s, 8], replicated
        h = h + self.down(F.gelu(heads.transpose(1, 2).reshape(b, s, 32)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def transposed(seed: int = 0):
    return _seeded(Transposed, seed)


def llama_ignoring():
    """examples/llama.py with some targets of -100, all in the first microbatch's rows."""
    module, (idx, targets) = llama.factory(batch=4)
    targets = targets.clone()
    targets[0, 1:] = -100
    return module, (idx, targets)


class SortsFeatures(RunningSum):
    """An operator with two results (values, indices) of which the model uses one."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + torch.sort(self.down(F.gelu(self.up(h))), dim=-1).values
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RotatedPairs(RunningSum):
    """DeepSeek-V3's shapes of rotary and key assembly, written out: even and odd features rotated
    by constant tables (pointwise ops with a table: whole along the dims it spans, the sequence
    here), joined by `cat` along the features, and one shared row `expand`ed over the heads of a
    column-parallel projection before a cat with them. No op runs replicated."""

    def __init__(self) -> None:
        super().__init__()
        angles = torch.arange(8.0)[:, None] * 0.5 ** torch.arange(8.0)  # [seq, pairs]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.shared = nn.Linear(16, 4, bias=False)
        self.down = nn.Linear(48, 16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        b, s, _ = h.shape
        x1, x2 = h[..., 0::2], h[..., 1::2]
        cos, sin = self.cos[:s], self.sin[:s]
        h = h + torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        heads = self.up(h).view(b, s, 4, 8)
        shared = self.shared(h).view(b, s, 1, 4).expand(-1, -1, 4, -1)
        h = h + self.down(F.gelu(torch.cat([heads, shared], dim=-1)).reshape(b, s, 48))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def rotated_pairs(seed: int = 0):
    return _seeded(RotatedPairs, seed)



class PairRotaryAttention(llama.Attention):
    """examples/llama.py's attention written as torchtune writes it: a rotary embedding that
    rotates adjacent pairs of head_dim (the pairs viewed as a last dim of 2, each half selected,
    the rotated halves stacked back and flattened), not fivedc's half-split rope, and k/v
    repeated over the heads by unsqueeze, expand and flatten. The rotary's ops run on shards,
    the attention sees head_dim as one dim again (fivedc/frontends/fx/generic.py `merged`) and
    the repeat is grouped-query attention's."""

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        freqs = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * freqs
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        pairs = x.reshape(*x.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.rotate(self.wq(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.rotate(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        shape = (b, self.n_kv_heads, self.n_rep, s, self.head_dim)
        k = k.unsqueeze(2).expand(shape).flatten(1, 2)
        v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def pair_rotary(seed: int = 0):
    """examples/llama.py's Llama (grouped-query attention) with `PairRotaryAttention` in each layer."""
    args = llama.ModelArgs()
    module, inputs = llama.factory(seed=seed, args=args, model_class=PairRotaryLlama)
    return module, inputs


class PairRotaryLlama(llama.Transformer):
    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        for block in self.layers:
            block.attention = PairRotaryAttention(args)


class ComplexRotary(nn.Module):
    """Meta's rotary embedding (and torchtitan's ComplexRoPE): the pairs of head_dim as complex
    numbers times a complex table `freqs_cis` (a complex64 buffer, computed in float32)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, heads, head_dim)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        table = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
        return torch.view_as_real(pairs * table).flatten(3).type_as(x)


class ComplexRotaryLlama(llama.Transformer):
    """examples/llama.py's Llama with `ComplexRotary` in each layer and its layers in an
    `nn.ModuleDict` (as torchtitan keeps them)."""

    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        for block in self.layers:
            block.attention.rope = ComplexRotary(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(self.layers)})

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def complex_rotary(seed: int = 0):
    """In float32, as such a model is built: a check in float64 casts it (the table to complex128)."""
    args = llama.ModelArgs()
    torch.manual_seed(seed)
    model = ComplexRotaryLlama(args)
    tokens, targets = (torch.randint(0, args.vocab_size, (2, args.max_seq_len)) for _ in range(2))
    return model, (tokens, targets)


class ReluSquaredAttention(llama.Attention):
    """Attention as research code writes it by hand, which is none the IR knows: the scores
    `q @ k^T`, ReLU² of them instead of a softmax, over a causal sliding window of 3 made with
    tril and triu, then `@ v`. Both matmuls take two activations: they run on shards of the
    batch and the heads (the `matmul` rule of fivedc/ir/aten_call.py), the key positions whole."""

    window = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.head_dim
        ones = torch.ones(s, s, dtype=torch.bool)
        window = torch.tril(ones) & torch.triu(ones, -(self.window - 1))
        probs = torch.relu(scores).square().masked_fill(~window, 0.0) / s
        out = torch.matmul(probs, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class ReluSquaredBlock(llama.TransformerBlock):
    """The residual added after the attention's output, as torchtune writes it."""

    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        self.attention = ReluSquaredAttention(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.attention_norm(x)) + x
        return self.feed_forward(self.ffn_norm(h)) + h


class ReluSquaredLlama(llama.Transformer):
    block = ReluSquaredBlock


def relu_squared(seed: int = 0):
    """examples/llama.py's Llama (grouped-query attention) with `ReluSquaredAttention` in each layer."""
    return llama.factory(seed=seed, args=llama.ModelArgs(), model_class=ReluSquaredLlama)


class TiedAfterAnIsland(RunningSum):
    """A table tied between the embedding, whose work is split over the tokens, and the head,
    which reads the sequence reversed (an op without a rule: whole on every rank), so its work
    is whole over dp and cp: its gradient there must count once in the table's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(torch.flip(h, dims=[1]))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tied_after_an_island(seed: int = 0):
    return _seeded(TiedAfterAnIsland, seed)


class WeightlessNorms(RunningSum):
    """LayerNorm and RMSNorm without weights (OLMo's non-parametric LayerNorm): ATen norms
    along the features, computed on shards of the batch and the sequence."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(F.layer_norm(h, (16,)))))
        logits = self.head(F.rms_norm(h, (16,), eps=1e-6))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def weightless_norms(seed: int = 0):
    return _seeded(WeightlessNorms, seed)


class PicksFeatures(RunningSum):
    """Features picked by constant lists: `h[..., [1, 3, 5, ...]]` (evenly spaced: a slice)
    and `h[..., [0, 1, 4, ...]]` (not: an index by a tensor)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        odd = h[..., [1, 3, 5, 7, 9, 11, 13, 15]]
        picked = h[..., [0, 1, 4, 6, 8, 9, 12, 15]]
        h = h + self.down(F.gelu(self.up(torch.cat([odd * picked, h[..., [-8, -7, -6, -5, -4, -3, -2, -1]]], -1))))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def picks_features(seed: int = 0):
    return _seeded(PicksFeatures, seed)


class ComputedNormWeights(RunningSum):
    """Norms whose weight and bias are computed from parameters (Nemotron's `1 + w`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(16) * 0.1)
        self.shift = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(F.layer_norm(h, (16,), self.gain + 1.0, self.shift * 2.0))))
        logits = self.head(F.rms_norm(h, (16,), 1.0 - self.gain, eps=1e-6))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def computed_norm_weights(seed: int = 0):
    return _seeded(ComputedNormWeights, seed)


class AlibiAttention(llama.Attention):
    """Attention with linear biases (ALiBi) written as BLOOM writes it: the scores one
    `baddbmm` of the distance penalty (a constant [batch x heads, seq, seq] table: a slope per
    head times the distance, the same in every batch row) and `q @ k^T` scaled, over batch and
    heads merged into one dim; a causal softmax, then `bmm` with v. `per_row` adds the batch
    row's index to its penalty: a constant that differs between batch rows."""

    per_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        q, k, v = (t.reshape(b * self.n_heads, s, self.head_dim) for t in (q, k, v))
        positions = torch.arange(s)
        slopes = 2.0 ** -torch.arange(1, self.n_heads + 1, dtype=x.dtype)
        distance = (positions[:, None] - positions[None, :]).abs().to(x.dtype)
        penalty = -(slopes[:, None, None] * distance).expand(b, -1, -1, -1)
        if self.per_row:
            penalty = penalty + torch.arange(b, dtype=x.dtype)[:, None, None, None]
        penalty = penalty.reshape(b * self.n_heads, s, s)
        scores = torch.baddbmm(penalty, q, k.transpose(1, 2), beta=1.0, alpha=self.head_dim ** -0.5)
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), v).view(b, self.n_heads, s, self.head_dim)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class AlibiBlock(ReluSquaredBlock):
    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        self.attention = AlibiAttention(args)


class AlibiLlama(llama.Transformer):
    block = AlibiBlock


def alibi(seed: int = 0):
    """examples/llama.py's Llama with `AlibiAttention` in each layer."""
    return llama.factory(seed=seed, args=llama.ModelArgs(), model_class=AlibiLlama)


def per_row_alibi(seed: int = 0):
    """`alibi` with a penalty that differs between batch rows."""
    module, inputs = alibi(seed)
    for layer in module.layers:
        layer.attention.per_row = True
    return module, inputs


class OffsetPositions(RunningSum):
    """Learned positions read at an offset, the same row for every sequence of the batch (OPT's
    `embed_positions(positions + 2)`): `[batch, seq]` constant indices 2..seq+1; `twice` also
    reads another table there summed over the batch, which no broadcast of one row gives."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.positions = nn.Embedding(12, 16)
        self.other = nn.Embedding(12, 16) if twice else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        where = torch.arange(s).expand(b, s) + 2
        h = self.emb(idx) + self.positions(where).to(self.emb.weight.dtype)
        if self.other is not None:
            h = h + self.other(where).sum(0) * 0.5
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def offset_positions(seed: int = 0, twice: bool = False):
    return _seeded(lambda: OffsetPositions(twice), seed)
