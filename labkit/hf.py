"""Hugging Face Transformers models in the lab: a small GPT-2 (tied embeddings) and a small Llama (RMSNorm,
rotary buffers, untied head), built from configs with random weights; nothing is downloaded.

`HFCausalLM` wraps one so that every engine trains it as it trains the lab's GPT: `model(tokens)` returns
the logits, and `model.blocks` is the model's own decoder layers (`GPT2Block`, `LlamaDecoderLayer`), the
units each engine shards one at a time. Inside, the model runs as Transformers wrote it (keyword inputs,
a `ModelOutput` out).
"""

from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("hf-gpt2", "hf-llama")


class HFCausalLM(nn.Module):
    """A Transformers causal LM behind the lab's interface: tokens in, logits out, `blocks` its layers."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers, the same objects the model runs (not registered twice)."""
        inner = getattr(self.hf, "transformer", None) or self.hf.model  # GPT-2's, Llama's
        return inner.h if hasattr(inner, "h") else inner.layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def hf_config(cfg):
    """The Transformers config of a lab `ModelConfig` of family hf-gpt2 or hf-llama: the same widths,
    depth and context; no dropout, no cache, token ids inside the vocabulary."""
    from transformers import GPT2Config, LlamaConfig

    common = {"vocab_size": cfg.vocab_size, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    if cfg.family == "hf-gpt2":
        return GPT2Config(
            n_embd=cfg.d_model,
            n_head=cfg.n_heads,
            n_layer=cfg.n_layers,
            n_positions=cfg.seq_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    if cfg.family == "hf-llama":
        return LlamaConfig(
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_mlp,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=max(1, cfg.n_heads // 2),
            max_position_embeddings=cfg.seq_len,
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(
        f"model family {cfg.family!r} is not a Hugging Face one; choose one of {', '.join(FAMILIES)}"
    )


def build_hf(cfg, seed: int) -> HFCausalLM:
    """The model of `cfg` with float32 weights that depend only on `seed` (Transformers' own init, seeded;
    the global random state is left as it was)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    model_class = GPT2LMHeadModel if cfg.family == "hf-gpt2" else LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = model_class(hf_config(cfg))
    return HFCausalLM(hf.float().train())
