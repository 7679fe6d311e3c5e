"""The lab's model and data: a small GPT (embeddings, a stack of blocks, a head) and synthetic batches.

Every engine trains this model, so it is built the same way everywhere: `build_model(name, seed)` gives
bit-identical float32 weights whatever the process, and `batch(step, ...)` gives the same global batch of
step k whatever the world size, each rank taking an equal, contiguous slice of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a lab model. Widths in elements, lengths in tokens. `family`: "gpt" (the lab's own, below)
    or a Hugging Face one ("hf-gpt2", "hf-llama": `labkit.hf`, the same widths in its config)."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    global_batch: int  # sequences per step, split evenly across ranks
    family: str = "gpt"

    @property
    def d_mlp(self) -> int:
        return 4 * self.d_model


CONFIGS: dict[str, ModelConfig] = {
    # Every dim-0 size (192, 96, 288, 384, 48) divides by 12, so 2, 3 and 4 ranks shard without padding.
    "tiny": ModelConfig(vocab_size=192, d_model=96, n_heads=4, n_layers=4, seq_len=48, global_batch=12),
    # Deliberately uneven: 101, 50, 150, 200 and 17 do not divide by 3 or 4 (101 and 17 by nothing),
    # so sharding must pad. Used by the padding lessons and the uneven-shape tests.
    "tiny_uneven": ModelConfig(
        vocab_size=101, d_model=50, n_heads=5, n_layers=3, seq_len=17, global_batch=12
    ),
    # For the prefetch benchmark: tiny's widths, 16 blocks. What prefetch cannot hide (the root's
    # collectives, block 0's forward gather and reduce-scatter, the last block's backward gather) is then
    # 8% of the traffic instead of tiny's 31%.
    "tiny_deep": ModelConfig(vocab_size=192, d_model=96, n_heads=4, n_layers=16, seq_len=48, global_batch=12),
    # For benchmarks: about 14M parameters.
    "small": ModelConfig(vocab_size=4096, d_model=384, n_heads=6, n_layers=6, seq_len=96, global_batch=12),
    # For a GPU hub (benchmarks/gpu.py's MFU): a GPT-2-small-like ~124M model and a ~1B one, the same code
    # path as tiny (12 sequences a step: 2, 3 and 4 ranks divide it); far too big for a CPU step at their batch.
    "gpt-125m": ModelConfig(
        vocab_size=24576, d_model=768, n_heads=12, n_layers=12, seq_len=1024, global_batch=12
    ),
    "gpt-1b": ModelConfig(
        vocab_size=24576, d_model=2048, n_heads=16, n_layers=18, seq_len=1024, global_batch=12
    ),
    # Hugging Face Transformers models (labkit.hf), random weights from a config: GPT-2 ties its head to
    # the token embedding; Llama has RMSNorm, rotary buffers, grouped-query attention and an untied head.
    # Uneven against 3 and 4 ranks on purpose (vocabulary 101, context 17).
    "hf-gpt2": ModelConfig(
        vocab_size=101, d_model=48, n_heads=4, n_layers=3, seq_len=17, global_batch=12, family="hf-gpt2"
    ),
    "hf-llama": ModelConfig(
        vocab_size=101, d_model=48, n_heads=4, n_layers=3, seq_len=17, global_batch=12, family="hf-llama"
    ),
}


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). The unit ZeRO-3 shards."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.out = nn.Linear(cfg.d_mlp, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `n_layers` blocks in `self.blocks`, a final norm and an untied head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def config(name: str) -> ModelConfig:
    """The `ModelConfig` called `name`; "NAME@B" is model NAME with a global batch of B sequences per step
    (`with_batch`: the same weights, more or fewer tokens per rank). A clear error for an unknown name."""
    base, at, sequences = name.partition("@")
    if base not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(CONFIGS)}")
    if not at:
        return CONFIGS[base]
    if not sequences.isdigit() or int(sequences) < 1:
        raise ValueError(
            f"model {name!r}: after '@' pass the sequences of one step, a whole number 1 or more (e.g. {base}@24)"
        )
    return replace(CONFIGS[base], global_batch=int(sequences))


def with_batch(name: str, sequences: int) -> str:
    """The name of model `name` with a global batch of `sequences` per step ("tiny@48"): `config` reads it."""
    return f"{name.partition('@')[0]}@{sequences}"


def build_model(name: str = "tiny", seed: int = 0) -> nn.Module:
    """A float32 model on the CPU whose weights depend only on (`name`, `seed`): the lab's GPT, or a Hugging
    Face model (`labkit.hf.HFCausalLM`) for the hf-* names. Either maps tokens to logits."""
    cfg = config(name)
    if cfg.family != "gpt":
        from labkit.hf import build_hf

        return build_hf(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(initial_value(pname, p.shape, gen))
    return model


def initial_value(pname: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """The lab's GPT's initial value of parameter `pname` (float32, CPU): biases 0, LayerNorm weights 1, the
    rest normal(0, 0.02) drawn from `gen`, one parameter after another in `named_parameters` order."""
    if pname.endswith("bias"):
        return torch.zeros(shape)
    if ".ln" in pname or pname.startswith("ln_f"):
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


@functools.cache
def block_class(name: str) -> type[nn.Module]:
    """The class of `name`'s blocks (its units): `Block` for the lab's GPT, the decoder layer of a Hugging
    Face model (`GPT2Block`, `LlamaDecoderLayer`)."""
    return Block if config(name).family == "gpt" else type(build_model(name).blocks[0])


def count_params(model: nn.Module) -> int:
    """Number of parameters (elements) of an unsharded model."""
    return sum(p.numel() for p in model.parameters())


def batch(
    step: int, name: str = "tiny", seed: int = 0, world_size: int = 1, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of step `step`: (tokens, targets), each (B/n, seq_len) int64.

    The data follow a fixed random bigram rule (the next token is `perm[prev]` nine times in ten), so the
    loss has something to learn and falls over the first steps.
    """
    cfg = config(name)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if cfg.global_batch % world_size:
        raise ValueError(
            f"world_size={world_size} does not divide the global batch of {cfg.global_batch} sequences "
            f"of model {name!r}; pass a world size that divides it"
        )
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed + 7919))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    n_seq, n_tok = cfg.global_batch, cfg.seq_len + 1
    seq = torch.empty(n_seq, n_tok, dtype=torch.long)
    seq[:, 0] = torch.randint(cfg.vocab_size, (n_seq,), generator=gen)
    noise = torch.randint(cfg.vocab_size, (n_seq, n_tok), generator=gen)
    follow = torch.rand(n_seq, n_tok, generator=gen) < 0.9
    for t in range(1, n_tok):
        seq[:, t] = torch.where(follow[:, t], perm[seq[:, t - 1]], noise[:, t])
    per_rank = n_seq // world_size
    local = seq[rank * per_rank : (rank + 1) * per_rank]
    return local[:, :-1].contiguous(), local[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the (local) batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
