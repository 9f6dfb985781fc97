"""Hugging Face transformers decoders, tiny and randomly initialised, as fivedc factories.

Each function builds a model from the library itself (`transformers`, see the
`models` extra in pyproject.toml for the tested version) with a tiny config of that
architecture and wraps it so that `forward(input_ids, labels)` returns the library's
own causal-LM loss. No weights are downloaded. Use one as
`fivedc compile examples/hf_models.py:llama --mesh ...`, or list them with `ARCHITECTURES`.
`benchmarks/compatibility.py` runs them all and writes `docs/compatibility.md`.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, BATCH, SEQ = 64, 2, 8
_DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
_MOE = dict(_DENSE, num_local_experts=4, num_experts_per_tok=2)


def _configs():
    import transformers as T

    return {
        "llama": (T.LlamaConfig, _DENSE),
        "mistral": (T.MistralConfig, _DENSE),
        "qwen2": (T.Qwen2Config, _DENSE),
        "qwen3": (T.Qwen3Config, dict(_DENSE, head_dim=8)),
        "gemma": (T.GemmaConfig, dict(_DENSE, head_dim=8)),
        "gemma2": (T.Gemma2Config, dict(_DENSE, head_dim=8)),
        "gemma3": (T.Gemma3TextConfig, dict(_DENSE, head_dim=8)),
        "gpt2": (T.GPT2Config, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "mixtral": (T.MixtralConfig, _MOE),
        "qwen3_moe": (T.Qwen3MoeConfig, dict(_DENSE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32)),
        # multi-head latent attention: as many k/v heads as query heads, as DeepSeek-V3's own config has
        "deepseek_v3": (T.DeepseekV3Config, dict(_DENSE, num_key_value_heads=4, n_routed_experts=4,
                                                 num_experts_per_tok=2, n_group=1, topk_group=1,
                                                 moe_intermediate_size=32, first_k_dense_replace=1,
                                                 q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                                 qk_nope_head_dim=4, v_head_dim=8)),
        # beyond the list, each with a path of its own: fused QKV sliced and a rotary over all of
        # head_dim (an empty pass-through part); q/k norms over all heads before the view into them; one
        # k/v head (multi-query); interleaved rotary by strided slices; GPT-J's written-out attention; a
        # LayerNorm whose weight is computed (1 + w)
        "phi3": (T.Phi3Config, dict(_DENSE, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
        "olmo2": (T.Olmo2Config, dict(_DENSE, pad_token_id=0)),
        "falcon": (T.FalconConfig, dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
        "glm": (T.GlmConfig, dict(_DENSE, head_dim=8, pad_token_id=0)),
        "gptj": (T.GPTJConfig, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
        "nemotron": (T.NemotronConfig, dict(_DENSE, head_dim=8)),
        # ALiBi attention by baddbmm; learned positions read at an offset
        "bloom": (T.BloomConfig, dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
        "opt": (T.OPTConfig, dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64)),
        # more of the library, each with its library defaults: a rotary over part of head_dim (GPT-NeoX,
        # Phi, StableLM), parallel attention and MLP, LayerNorms with biases, ALiBi added to the scores
        # (MPT), multi-query attention with fused QKV (GPTBigCode), learned or sinusoidal positions,
        # local attention layers (GPT-Neo), scaling multipliers (Granite), more MoE blocks (OLMoE,
        # GraniteMoE), and dense decoders of newer families
        "gpt_neox": (T.GPTNeoXConfig, dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=64)),
        "phi": (T.PhiConfig, dict(_DENSE, partial_rotary_factor=0.5)),
        "stablelm": (T.StableLmConfig, dict(_DENSE, partial_rotary_factor=0.25)),
        "starcoder2": (T.Starcoder2Config, _DENSE),
        "granite": (T.GraniteConfig, dict(_DENSE, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.3, logits_scaling=4.0)),
        "mpt": (T.MptConfig, dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64)),
        "gpt_bigcode": (T.GPTBigCodeConfig, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                 multi_query=True)),
        "codegen": (T.CodeGenConfig, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                          n_positions=64, n_ctx=64)),
        "olmoe": (T.OlmoeConfig, dict(_DENSE, num_experts=4, num_experts_per_tok=2)),
        "granitemoe": (T.GraniteMoeConfig, dict(_DENSE, num_local_experts=4, num_experts_per_tok=2)),
        "cohere": (T.CohereConfig, _DENSE),
        "exaone4": (T.Exaone4Config, _DENSE),
        "gpt_neo": (T.GPTNeoConfig, dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                         attention_types=[[["global", "local"], 1]], max_position_embeddings=64)),
        "biogpt": (T.BioGptConfig, dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64)),
        "arcee": (T.ArceeConfig, _DENSE),
        "seed_oss": (T.SeedOssConfig, dict(_DENSE, head_dim=8)),
        "qwen2_moe": (T.Qwen2MoeConfig, dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64)),
    }


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gpt2", "mixtral", "qwen3_moe",
                 "deepseek_v3", "phi3", "olmo2", "falcon", "glm", "gptj", "nemotron", "bloom", "opt",
                 "gpt_neox", "phi", "stablelm", "starcoder2", "granite", "mpt", "gpt_bigcode", "codegen", "olmoe",
                 "granitemoe", "cohere", "exaone4", "gpt_neo", "biogpt", "arcee", "seed_oss", "qwen2_moe")


class CausalLMLoss(nn.Module):
    """The library's model, called as a training loop calls it: its loss for these labels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss  # training: no KV cache


class LogitsLoss(nn.Module):
    """The library's decoder under a training loop's own loss: cross-entropy of its logits
    against targets already shifted (as torchtitan's loop computes it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, loss: str = "library",
          weights: bool = True, **overrides) -> tuple[nn.Module, tuple]:
    """(model, (input_ids, labels)) for architecture `arch` (one of ARCHITECTURES); `loss`:
    "library" (the model's own loss for `labels`) or "logits" (`LogitsLoss`); `weights=False`:
    built under `fivedc.empty_weights()` (parameters on the meta device: it compiles, it does not
    train); `overrides`: config fields over the tiny defaults (`rope_scaling={"rope_type": "linear",
    "factor": 2.0}`)."""
    import contextlib

    import transformers as T

    import fivedc

    config_class, fields = _configs()[arch]
    torch.manual_seed(seed)
    config = config_class(**(fields | overrides))
    with contextlib.nullcontext() if weights else fivedc.empty_weights():
        try:
            model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:  # an architecture whose attention has no SDPA path
            model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    wrapper = CausalLMLoss if loss == "library" else LogitsLoss
    return wrapper(model).to(dtype), (ids, torch.roll(ids, -1, dims=1) if loss == "logits" else ids.clone())


def _factory(arch: str, default_loss: str = "library", **overrides):
    def factory(*, seed: int = 0, dtype: torch.dtype = torch.float64, loss: str = default_loss):
        return build(arch, seed=seed, dtype=dtype, loss=loss, **overrides)

    suffix = "_window" if overrides else "" if default_loss == "library" else "_logits"
    factory.__name__ = factory.__qualname__ = f"{arch}{suffix}"
    factory.__doc__ = f"Hugging Face {arch}, tiny config, random init, {default_loss} loss: (model, inputs)."
    return factory


(llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, gpt2, mixtral, qwen3_moe, deepseek_v3, phi3, olmo2, falcon, glm,
 gptj, nemotron, bloom, opt, gpt_neox, phi, stablelm, starcoder2, granite, mpt, gpt_bigcode, codegen, olmoe, granitemoe,
 cohere, exaone4, gpt_neo, biogpt, arcee, seed_oss, qwen2_moe) = map(_factory, ARCHITECTURES)
# the same decoders under a training loop's own logits loss (`LogitsLoss`): `examples/hf_models.py:llama_logits`
globals().update({f"{arch}_logits": _factory(arch, "logits") for arch in ARCHITECTURES})
# sliding windows shorter than the sequence (4 of SEQ = 8 positions): the mask is banded, not causal
WINDOW_ROWS = ("gemma2", "mistral", "gemma3")
globals().update({f"{arch}_window": _factory(arch, sliding_window=SEQ // 2) for arch in WINDOW_ROWS})
