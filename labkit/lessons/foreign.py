"""The scratch engine on a model the lab did not write: PyTorch's own `nn.TransformerEncoder` layers.

`EncoderLM` puts torch's encoder layers (widths that no rank count divides) between an embedding and a
head; `ZeRO3` shards it with `units=instances_of(nn.TransformerEncoderLayer)`, the parameters outside
every layer forming the root. `encoder_run` trains it on real ranks beside the single-process oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.engines import scratch, single
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_info, timed_step, to_rank_device
from labkit.probes import Probes, state_bytes
from labkit.units import instances_of, unit_plan

VOCAB, WIDTH, HEADS, FEED_FORWARD, LAYERS, SEQ = 29, 25, 5, 37, 2, 11
GLOBAL_BATCH = 12  # sequences per step: divides by 2, 3 and 4 ranks


class EncoderLM(nn.Module):
    """torch's TransformerEncoder layers (d_model 25, 5 heads, feed-forward 37) between an embedding and a
    head, with a causal mask kept as a buffer (left whole on every rank: buffers are not sharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), mask=self.causal, is_causal=True))


def build_encoder(seed: int = 0) -> EncoderLM:
    torch.manual_seed(seed)  # the same initial weights in every process
    return EncoderLM()


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: random tokens whose target is a fixed function of the token."""
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    return tokens, (3 * tokens + 1) % VOCAB


def encoder_run(steps: int = 3) -> dict[str, Any]:
    """On each rank: the encoder LM sharded by the scratch engine (one unit per encoder layer) and, beside
    it, the single-process oracle on the global batch. Losses per step (the scratch one a global mean),
    the units and their parameter counts, rank 0's wire bytes per collective in the last step, state bytes."""
    info = rank_info()
    cfg = RunConfig(world_size=info.world_size, steps=steps)
    oracle = single.SingleEngine(build_encoder(), cfg, info.device)
    model = to_rank_device(build_encoder())
    layers = instances_of(nn.TransformerEncoderLayer)
    engine = scratch.engine(model, cfg, info, units=layers)
    per = GLOBAL_BATCH // info.world_size
    losses, oracle_losses = [], []
    with Probes(info.rank, info.device) as probes:
        for step in range(steps):
            tokens, targets = token_batch(step)
            local = to_rank_device(
                (
                    tokens[info.rank * per : (info.rank + 1) * per],
                    targets[info.rank * per : (info.rank + 1) * per],
                )
            )
            with probes.step(step):
                loss, _ = timed_step(engine, step, local)
            dist.all_reduce(loss)
            losses.append(loss.item() / info.world_size)
            oracle_losses.append(timed_step(oracle, step, to_rank_device((tokens, targets)))[0].item())
    return {
        "losses": losses,
        "single_losses": oracle_losses,
        "units": {
            name: sum(p.numel() for _, p in params)
            for name, _, params in unit_plan(build_encoder(), layers, scratch.split_root(cfg, layers))
        },
        "comm": probes.comm.summary(steps - 1),
        "state_bytes": state_bytes(engine.state_tensors()),
        "params": sum(p.numel() for p in build_encoder().parameters()),
    }
