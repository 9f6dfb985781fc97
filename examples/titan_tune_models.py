"""torchtitan and torchtune decoders, tiny and randomly initialised, as fivedc factories.

A probe of fivedc's frontend on models written by others: each function builds a
decoder from the library itself (torchtitan's config builders, torchtune's component
builders) with a tiny config of that family, random weights and no downloads, and
wraps it so that `forward(input_ids, labels)` returns the mean cross-entropy of the
library model's logits against labels already shifted (`LogitsLoss`, as torchtitan's
training loop computes it), in float64 by default. Use one as
`fivedc compile examples/titan_tune_models.py:titan_llama3 --mesh ...`, or list them
with `ARCHITECTURES`; tests/test_titan_tune_models.py holds each to fivedc's rule.

Install without moving torch (the libraries pin nothing useful for a CPU checkout;
every package of the list is installed with --no-deps and none of them pulls torch):

    pip install --no-deps -r examples/titan_tune_requirements.txt

torchtitan's language models take `flex` or `varlen` attention only (its `sdpa` backend
is refused for LMs). `titan_llama3` keeps the default, a compiled flex_attention over a
document block mask (fivedc/frontends/fx/flex.py reads it as the causal attention it is);
the `*_sdpa` factories swap each layer's inner attention for the library's own
`ScaledDotProductAttention` (causal SDPA, what its Flux model builds).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, BATCH, SEQ, MAX_SEQ = 64, 2, 8, 16
DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 2, 4, 2, 8, 64

ARCHITECTURES = (
    "titan_llama3", "titan_llama3_sdpa", "titan_qwen3", "titan_qwen3_sdpa", "titan_qwen3_moe_sdpa",
    "titan_deepseek_v3", "titan_deepseek_v3_sdpa",
    "tune_llama2", "tune_llama3", "tune_llama3_2", "tune_qwen2", "tune_mistral", "tune_phi3", "tune_gemma",
    "tune_gemma2",
)


class LogitsLoss(nn.Module):
    """The library's decoder under a training loop's own loss: mean cross-entropy of its logits
    against targets already shifted. `masks`: torchtitan's flex/varlen attention wants the masks
    its model builds from token positions (`get_attention_masks`), as its trainer passes them."""

    def __init__(self, model: nn.Module, *, masks: bool = False) -> None:
        super().__init__()
        self.model = model
        self.masks = masks

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.masks:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            logits = self.model(input_ids, attention_masks=self.model.get_attention_masks(positions))
        else:
            logits = self.model(input_ids)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return ids, torch.roll(ids, -1, dims=1)


# --- torchtitan's auxiliary-loss-free load balancing, as its trainer runs it ---

def expert_bias_update(model: nn.Module):
    """The update torchtitan's trainer makes after each step to every MoE layer's expert bias
    (`_update_expert_bias` in torchtitan/components/optimizer/optimizer.py, there an optimizer step
    pre-hook; the bias is first read by the next forward either way), as an after-step hook on the
    buffers by key, so it runs alike on the plain module and on `fivedc.parallelize`'s:

        delta = coeff * sign(mean(tokens) - tokens);  bias += delta - mean(delta);  tokens = 0

    per layer, `tokens` being the layer's tokens per expert over the whole batch since the last
    update (its forward adds them: `tokens_per_expert_E.add_(...)` under no_grad). None when no
    layer balances (`load_balance_coeff` None)."""
    coeffs = {f"{path}.": m.load_balance_coeff for path, m in model.named_modules()
              if getattr(m, "load_balance_coeff", None) is not None and hasattr(m, "tokens_per_expert_E")}
    if not coeffs:
        return None

    def update(module: nn.Module) -> None:
        buffers = dict(module.named_buffers())
        for prefix, coeff in coeffs.items():
            tokens, bias = buffers[prefix + "tokens_per_expert_E"], buffers[prefix + "expert_bias_E"]
            delta = coeff * torch.sign(tokens.mean() - tokens).to(bias.dtype)
            bias.add_(delta - delta.mean())
            tokens.zero_()

    return update


# --- torchtitan: the library's config builders (its own per-family layer builders and inits) ---

def _titan_sdpa(config):
    """Each layer's inner attention as the library's causal `ScaledDotProductAttention`."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _titan_llama3_config():
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return L.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=MAX_SEQ, theta=500000, scaling="llama"),
            attn_backend="flex"),
    )


def _titan_qwen3_config(moe: bool):
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=MAX_SEQ, theta=1000000.0)
    common = dict(fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  attn_backend="flex", rope=rope)
    if moe:
        layers = Q._build_qwen3_moe_layers(**common, moe_hidden_dim=32, num_experts=4, top_k=2,
                                          moe_comm_backend="standard")
    else:
        layers = Q._build_qwen3_layers(**common, hidden_dim=FFN)
    return Q.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=Q._qwen3_norm(DIM), enable_weight_tying=not moe,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=Q._EMBEDDING_INIT if moe else Q._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=Q._LINEAR_INIT),
        layers=layers,
    )


def _titan_deepseek_v3_config():
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    rope_dim = 4
    layers = D._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.70, dense_hidden_dim=FFN,
        moe_hidden_dim=32, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=MAX_SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=MAX_SEQ // 4),
    )
    return D.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=D._output_linear_init(DIM)),
        layers=layers,
        mtp_layers=[],
    )


def _titan(config_fn, *, sdpa: bool):
    def build(*, seed: int = 0, dtype: torch.dtype = torch.float64):
        torch.manual_seed(seed)
        config = config_fn()
        if sdpa:
            config = _titan_sdpa(config)
        # built in `dtype` rather than cast with `.to(dtype)`: a cast would turn ComplexRoPE's complex64
        # cache into real numbers (dropping the imaginary part); its caches stay as the library makes them
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = config.build()
            model.init_states()  # the library's own param_init for every weight, and its RoPE caches
        finally:
            torch.set_default_dtype(default)
        wrapped = LogitsLoss(model, masks=not sdpa)
        wrapped.fivedc_after_step = expert_bias_update(wrapped)  # the trainer's bias update (None: no MoE)
        return wrapped, _inputs()

    return build


# --- torchtune: the library's component builders ---

def _tune(family: str, **fields):
    def build(*, seed: int = 0, dtype: torch.dtype = torch.float64):
        import importlib

        builder = getattr(importlib.import_module(f"torchtune.models.{family}._component_builders"), family)
        torch.manual_seed(seed)
        model = builder(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=DIM,
                        max_seq_len=MAX_SEQ, **fields)
        return LogitsLoss(model).to(dtype), _inputs()

    return build


def _named(name: str, build, doc: str):
    def factory(*, seed: int = 0, dtype: torch.dtype = torch.float64):
        return build(seed=seed, dtype=dtype)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"{doc}, tiny config, random init, logits cross-entropy: (model, (input_ids, labels))."
    return factory


titan_llama3 = _named("titan_llama3", _titan(_titan_llama3_config, sdpa=False),
                      "torchtitan Llama3Model (flex attention, complex RoPE)")
titan_llama3_sdpa = _named("titan_llama3_sdpa", _titan(_titan_llama3_config, sdpa=True),
                           "torchtitan Llama3Model with causal SDPA")
titan_qwen3_sdpa = _named("titan_qwen3_sdpa", _titan(lambda: _titan_qwen3_config(False), sdpa=True),
                          "torchtitan Qwen3Model (qk-norm, cos/sin RoPE, tied table) with causal SDPA")
titan_qwen3_moe_sdpa = _named("titan_qwen3_moe_sdpa", _titan(lambda: _titan_qwen3_config(True), sdpa=True),
                              "torchtitan Qwen3Model MoE (grouped experts) with causal SDPA")
titan_deepseek_v3_sdpa = _named("titan_deepseek_v3_sdpa", _titan(_titan_deepseek_v3_config, sdpa=True),
                                "torchtitan DeepSeekV3Model (MLA, MoE with a shared expert) with causal SDPA")
titan_qwen3 = _named("titan_qwen3", _titan(lambda: _titan_qwen3_config(False), sdpa=False),
                     "torchtitan Qwen3Model (qk-norm, cos/sin RoPE, tied table, flex attention)")
titan_deepseek_v3 = _named("titan_deepseek_v3", _titan(_titan_deepseek_v3_config, sdpa=False),
                           "torchtitan DeepSeekV3Model (MLA, MoE with a shared expert, flex attention)")

tune_llama2 = _named("tune_llama2", _tune("llama2", intermediate_dim=FFN), "torchtune llama2")
tune_llama3 = _named("tune_llama3", _tune("llama3", intermediate_dim=FFN), "torchtune llama3")
tune_llama3_2 = _named("tune_llama3_2", _tune("llama3_2", intermediate_dim=FFN),
                       "torchtune llama3_2 (scaled RoPE, tied table)")
tune_qwen2 = _named("tune_qwen2", _tune("qwen2", intermediate_dim=FFN), "torchtune qwen2 (q/k/v biases)")
tune_mistral = _named("tune_mistral", _tune("mistral", intermediate_dim=FFN), "torchtune mistral")
tune_phi3 = _named("tune_phi3", _tune("phi3", intermediate_dim=FFN), "torchtune phi3")
tune_gemma = _named("tune_gemma", _tune("gemma", head_dim=HEAD_DIM, intermediate_dim=FFN),
                    "torchtune gemma (1 + w RMSNorm, scaled embedding, tied table)")
tune_gemma2 = _named("tune_gemma2", _tune("gemma2", head_dim=HEAD_DIM, intermediate_dim=FFN, sliding_window_size=4),
                     "torchtune gemma2 (logit soft-capping, sliding window)")
