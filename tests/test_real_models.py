"""labkit's ZeRO-3 on models it was not written for, each against the `single` oracle (fp32, rel 1e-4).

The models: a GPT-2 (`Gpt2LMHead`, a re-implementation in this file of Hugging Face's GPT-2 architecture from
its public description: Conv1D weights stored (in, out), a causal-mask buffer, the token embedding tied to
the head), `torch.nn.TransformerEncoder` layers (widths that divide neither 2, 3 nor 4), and MLP-Mixer as
the `mlp-mixer-pytorch` package writes it. What they exercise: units chosen by the user (modules, or
`instances_of` a class), tied weights, a block called twice in one forward, frozen parameters, a parameter
and a whole unit that a step does not use, buffers, a root with no parameters, HSDP, and a checkpoint of a
frozen and tied model resharded 4 -> 3.

The oracle is the `single` engine itself (`labkit.engines.single`: plain `torch.optim.AdamW` built by
`labkit.engines.base.adamw`, gradients zeroed between steps) on the global batch; the sharded side is the
`scratch` engine given the units. Both take the same seed, batches and step function
(`labkit.engines.on_rank.timed_step`). One launch per world size trains every case twice (a race would show as
a difference between the two runs) and feeds every test below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_helpers import one_thread
from mlp_mixer_pytorch import MLPMixer
from mlp_mixer_pytorch.mlp_mixer_pytorch import PreNormResidual
from torch import nn

import labkit
from labkit import budget
from labkit.engines import scratch, single
from labkit.engines.base import RankInfo, RunConfig
from labkit.engines.on_rank import rank_info, timed_step
from labkit.lessons.foreign import EncoderLM
from labkit.probes import state_bytes
from labkit.units import instances_of, model_units
from labkit.zero import checkpoint

STEPS = 4
GLOBAL_BATCH = 12  # divides by 2, 3 and 4
CFG = RunConfig(steps=STEPS)  # the lab's AdamW hyper-parameters, for both sides


# ------------------------------------------------------------------------------------------ GPT-2


@dataclass(frozen=True)
class Gpt2Config:
    vocab_size: int = 53  # prime: the tied embedding's rows pad on every world size
    n_positions: int = 11
    n_embd: int = 20  # c_attn/c_fc weights are (20, out): 20 rows pad on 3 ranks
    n_head: int = 4
    n_layer: int = 2
    schedule: tuple[int, ...] | None = None  # the blocks' call order; (0, 1, 0) calls block 0 twice
    adapter: bool = False  # a per-block adapter used on even steps only
    skip_last_on_odd: bool = False  # the last block is skipped on odd steps


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 Conv1D: a linear layer whose weight is stored (in, out), x @ W + b."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Gpt2Attention(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        n = cfg.n_positions
        self.register_buffer("bias", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n))
        self.n_head = cfg.n_head
        self.c_attn = Conv1D(3 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        w = (q @ k.transpose(-1, -2)) / math.sqrt(v.shape[-1])
        w = torch.where(self.bias[:, :, :t, :t], w, torch.finfo(w.dtype).min)
        return self.c_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class Gpt2Block(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Gpt2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.ModuleDict(
            {"c_fc": Conv1D(4 * cfg.n_embd, cfg.n_embd), "c_proj": Conv1D(cfg.n_embd, 4 * cfg.n_embd)}
        )
        self.adapter = nn.Linear(cfg.n_embd, cfg.n_embd) if cfg.adapter else None

    def forward(self, x: torch.Tensor, use_adapter: bool = False) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))
        return x + self.adapter(x) if use_adapter else x


class Gpt2Model(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Gpt2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.step = 0  # set by the trainer: which blocks and adapters this step uses
        # A running statistic, like BatchNorm's num_batches_tracked: it must be left alone, not sharded.
        self.register_buffer("forwards_seen", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards_seen += 1
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        order = list(self.cfg.schedule or range(len(self.h)))
        if self.cfg.skip_last_on_odd and self.step % 2:
            order = order[:-1]
        for i in order:
            x = self.h[i](x, use_adapter=self.cfg.adapter and self.step % 2 == 0)
        return self.ln_f(x)


class Gpt2LMHead(nn.Module):
    """GPT-2 with its language-model head tied to the token embedding, as Hugging Face ties them."""

    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.transformer = Gpt2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(tokens))


# ------------------------------------------------------------------------------------------ others


def mixer() -> nn.Module:
    """MLP-Mixer from the mlp-mixer-pytorch package: 9 patches of a 6x6 image (token-mixing Conv1d weights
    of 9 rows), width 10, 7 classes."""
    return MLPMixer(image_size=6, channels=3, patch_size=2, dim=10, depth=2, num_classes=7)


# ------------------------------------------------------------------------------------------ cases


def token_batch(step: int, vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: random tokens whose target is a fixed function of the token."""
    tokens = torch.randint(vocab, (GLOBAL_BATCH, seq), generator=torch.Generator().manual_seed(1000 + step))
    return tokens, (3 * tokens + 1) % vocab


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    images = torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=gen)
    return images, (images.mean(dim=(1, 2)).argmax(-1) % 7)


def freeze(model: Gpt2LMHead) -> Gpt2LMHead:
    """Fine-tuning's freeze: the position embedding, all of block 0 (a unit with nothing to train, whose
    backward is still needed: the tied embedding below it trains) and the final norm's bias."""
    for p in [
        model.transformer.wpe.weight,
        *model.transformer.h[0].parameters(),
        model.transformer.ln_f.bias,
    ]:
        p.requires_grad_(False)
    return model


def blocks(model: Gpt2LMHead) -> list[nn.Module]:
    return list(model.transformer.h)


def gpt2_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, Gpt2Config.vocab_size, Gpt2Config.n_positions)


CASES: dict[str, dict[str, Any]] = {
    # tied embedding and head (both in the root), a block called twice per forward, two buffers
    "gpt2_tied": {"build": lambda: Gpt2LMHead(Gpt2Config(schedule=(0, 1, 0))), "units": blocks},
    "gpt2_frozen": {"build": lambda: freeze(Gpt2LMHead(Gpt2Config(n_layer=3))), "units": blocks},
    # each block's adapter unused on odd steps, and the last block (a whole unit) skipped on them
    "gpt2_unused": {
        "build": lambda: Gpt2LMHead(Gpt2Config(n_layer=3, adapter=True, skip_last_on_odd=True)),
        "units": blocks,
    },
    "encoder": {
        "build": EncoderLM,  # labkit.lessons.foreign's, which notebook 05 shows
        "units": lambda m: instances_of(nn.TransformerEncoderLayer),
    },
    "mixer": {"build": mixer, "units": lambda m: instances_of(PreNormResidual)},
    # every parameter in a leaf unit: the root has none of its own
    "mixer_leaves": {"build": mixer, "units": lambda m: instances_of(nn.Linear, nn.Conv1d, nn.LayerNorm)},
}
for case in CASES.values():
    case.setdefault("batch", gpt2_batch)
CASES["encoder"]["batch"] = lambda step: token_batch(step, 29, 11)
CASES["mixer"]["batch"] = CASES["mixer_leaves"]["batch"] = image_batch
HSDP_CASE = "gpt2_frozen"  # also trained under HSDP, in shard groups of 2 on 4 ranks


def build(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return CASES[name]["build"]()


def local_slice(data: tuple[torch.Tensor, ...], rank: int, n: int) -> tuple[torch.Tensor, ...]:
    per = GLOBAL_BATCH // n
    return tuple(t[rank * per : (rank + 1) * per] for t in data)


def train(engine, model: nn.Module, name: str, steps: range, shard: tuple[int, int] | None):
    """Steps of `engine` on the case's batches: the global mean loss of each (this rank's slice if
    `shard` = (rank, n)), and after each step the largest |gradient| of the adapters (unused on odd steps)."""
    losses, adapter_grads = [], []
    for step in steps:
        if hasattr(model, "transformer"):
            model.transformer.step = step
        data = CASES[name]["batch"](step)
        if shard:  # this rank's slice, on this rank's device (the scratch engine does not move its inputs)
            data = tuple(t.to(rank_info().device) for t in local_slice(data, *shard))
        loss, _ = timed_step(engine, step, data)
        if shard:
            dist.all_reduce(loss)
            loss /= shard[1]
        losses.append(loss.item())
        if shard:
            grads = [s.grad.abs().max().item() for n, s in engine.zero.named_shards() if "adapter" in n]
            adapter_grads.append(max(grads, default=None))
    return losses, adapter_grads


# ------------------------------------------------------------------------------------------ ranks


def _sharded_run(name: str, options: dict | None = None) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    model = build(name)
    buffers = dict(model.named_buffers())
    cfg = replace(CFG, world_size=n, options=options or {})
    engine = scratch.ScratchEngine(model, cfg, rank_info(), units=CASES[name]["units"](model))
    frozen_before = [s.clone() for s, p in _shards_and_params(engine) if not p.requires_grad]
    losses, adapter_grads = train(engine, model, name, range(STEPS), (rank, n))
    frozen_after = [s for s, p in _shards_and_params(engine) if not p.requires_grad]
    return {
        "losses": losses,
        "adapter_grads": adapter_grads,
        "buffers": {k: b.cpu().clone() for k, b in model.named_buffers()},
        # the same tensors, whole: ZeRO3 shards parameters only
        "buffers_untouched": [k for k, b in model.named_buffers() if b is buffers[k]] == list(buffers),
        "frozen_unchanged": all(torch.equal(a, b) for a, b in zip(frozen_before, frozen_after, strict=True)),
        "frozen_grads": [p.grad for s, p in _shards_and_params(engine) if not p.requires_grad],
        "state_bytes": state_bytes(engine.state_tensors()),
        "units": [u.name for u in engine.zero.units],
    }


def _shards_and_params(engine) -> list[tuple[torch.Tensor, nn.Parameter]]:
    return [(sp.shard, sp.param) for u in engine.zero.units for sp in u.params]


def _checkpoint_run(path: str, mode: str) -> list[float]:
    """`save`: 3 steps, a checkpoint, 3 more; `load`: the checkpoint, then those 3 steps."""
    n, rank = dist.get_world_size(), dist.get_rank()
    model = build(HSDP_CASE)
    engine = scratch.ScratchEngine(model, replace(CFG, world_size=n), rank_info(), units=blocks(model))
    if mode == "save":
        train(engine, model, HSDP_CASE, range(3), (rank, n))
        checkpoint.save(path, engine.zero, engine.optimizer)
    else:
        checkpoint.load(path, engine.zero, engine.optimizer)
    return train(engine, model, HSDP_CASE, range(3, 6), (rank, n))[0]


def _all_cases(path: str, mode: str | None) -> dict:
    """Every case twice, HSDP on 4 ranks, and the checkpoint's half for this world size."""
    out: dict[str, Any] = {name: [_sharded_run(name), _sharded_run(name)] for name in CASES}
    if dist.get_world_size() == 4:
        out["hsdp"] = [_sharded_run(HSDP_CASE, {"hsdp_shard_size": 2}) for _ in range(2)]
    if mode is not None:
        out["checkpoint"] = _checkpoint_run(path, mode)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """Rank 0's results per world size: 4 first (it writes the checkpoint that 3 resumes from)."""
    path = str(tmp_path_factory.mktemp("ckpt"))
    modes = {4: "save", 3: "load", 2: None}
    return {n: labkit.launch(_all_cases, n, path, modes[n], timeout=300)[0] for n in (4, 3, 2)}


@pytest.fixture(scope="module")
def oracle() -> dict[str, dict]:
    """The `single` engine on the global batch, per case: losses and buffers after training."""
    out = {}
    with one_thread():  # as on every rank (`engine_helpers.one_thread` says why)
        for name in CASES:
            model = build(name)
            engine = single.build(CFG, model, RankInfo(0, 1, 0, torch.device("cpu"), "gloo"))
            losses, _ = train(engine, model, name, range(6 if name == HSDP_CASE else STEPS), None)
            out[name] = {"losses": losses, "buffers": dict(model.named_buffers())}
    return out


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_each_model_trains_like_single_twice_over(runs, oracle, name, n):
    first, second = runs[n][name]
    assert first["losses"] == second["losses"]  # bit for bit: no race between the runs
    assert rel(first["losses"], oracle[name]["losses"][:STEPS]) < 1e-4, first["losses"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_units_are_the_ones_chosen_and_shared_weights_sit_in_the_root(runs, n):
    assert runs[n]["gpt2_tied"][0]["units"] == ["root", "transformer.h.0", "transformer.h.1"]
    assert runs[n]["encoder"][0]["units"] == ["root", "encoder.layers.0", "encoder.layers.1"]
    assert runs[n]["mixer"][0]["units"] == ["root", *(f"{i}.{j}" for i in (2, 3) for j in (0, 1))]
    assert "root" not in runs[n]["mixer_leaves"][0]["units"]  # every parameter is in a leaf unit


@pytest.mark.parametrize("n", [2, 3, 4])
def test_buffers_are_left_whole_and_equal_the_oracles(runs, oracle, n):
    for name in ("gpt2_tied", "encoder"):
        r = runs[n][name][0]
        assert r["buffers_untouched"], name
        for key, want in oracle[name]["buffers"].items():
            assert torch.equal(r["buffers"][key], want), (name, key)
    assert int(runs[n]["gpt2_tied"][0]["buffers"]["transformer.forwards_seen"]) == STEPS


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_parameter_a_step_does_not_use_gets_a_zero_gradient_not_last_steps(runs, n):
    grads = runs[n]["gpt2_unused"][0]["adapter_grads"]
    assert all(g > 0 for g in grads[0::2]) and grads[1::2] == [0.0] * (STEPS // 2), grads


@pytest.mark.parametrize("n", [2, 3, 4])
def test_frozen_parameters_are_sharded_never_updated_and_drop_the_optimizers_share(runs, n):
    r = runs[n]["gpt2_frozen"][0]
    assert r["frozen_unchanged"] and r["frozen_grads"] == [None] * len(r["frozen_grads"])
    model = build("gpt2_frozen")
    params = list(model.parameters())  # the tied weight once
    padded = {id(p): budget.padded_numel(tuple(p.shape), n) // n for p in params}
    all_elems = sum(padded.values())
    trained = sum(padded[id(p)] for p in params if p.requires_grad)
    assert r["state_bytes"] == {"params": 4 * all_elems, "grads": 4 * trained, "optimizer": 8 * trained}
    assert r["state_bytes"] == scratch.state_bytes_accounting(model, RunConfig(world_size=n), n)
    # The budget says it too: with trainable_params the plan keeps the weights of every parameter and the
    # other terms of the trained ones (its counts given as the padded elements, so no padding of its own).
    frozen = budget.plan(n * all_elems, n, precision="fp32", trainable_params=n * trained)
    unfrozen = budget.plan(n * all_elems, n, precision="fp32")
    assert frozen["state_bytes_per_rank"] == sum(r["state_bytes"].values())
    assert unfrozen["state_bytes_per_rank"] - frozen["state_bytes_per_rank"] == 12 * (all_elems - trained)
    traffic = {t["key"]: t["payload_bytes"] for t in frozen["traffic_terms"]}
    assert traffic["reduce_scatter"] == 4 * n * trained and traffic["all_gather_forward"] == 4 * n * all_elems


def test_hsdp_trains_a_frozen_and_tied_model_like_single(runs, oracle):
    first, second = runs[4]["hsdp"]
    assert first["losses"] == second["losses"]
    assert rel(first["losses"], oracle[HSDP_CASE]["losses"][:STEPS]) < 1e-4
    padded = {id(p): budget.padded_numel(tuple(p.shape), 2) // 2 for p in build(HSDP_CASE).parameters()}
    assert first["state_bytes"]["params"] == 4 * sum(padded.values())  # 1/2 of the model, not 1/4


def test_a_checkpoint_of_a_frozen_and_tied_model_reshards_4_to_3_and_resumes(runs, oracle):
    uninterrupted, resumed = runs[4]["checkpoint"], runs[3]["checkpoint"]
    assert rel(resumed, uninterrupted) < 1e-5
    assert rel(uninterrupted, oracle[HSDP_CASE]["losses"][3:]) < 1e-4


# ------------------------------------------------------------------------------------------ units


def test_model_units_puts_a_tied_weight_in_the_root_and_drops_a_unit_left_empty():
    model = Gpt2LMHead(Gpt2Config())
    units = model_units(model, [*blocks(model), model.lm_head])
    assert [name for name, _, _ in units] == ["root", "transformer.h.0", "transformer.h.1"]
    root = dict(units[0][2])
    assert root["transformer.wte.weight"] is model.lm_head.weight
    frozen = freeze(Gpt2LMHead(Gpt2Config()))
    block0 = model_units(frozen, blocks(frozen))[1]
    assert block0[0] == "transformer.h.0" and not any(p.requires_grad for _, p in block0[2])
    with pytest.raises(
        ValueError, match=r"^unit 2.0.fn.1 has no parameters to shard; leave it out of units$"
    ):
        model_units(mixer(), instances_of(nn.GELU))


@pytest.mark.parametrize(
    "units, message",
    [
        (
            lambda m: [m.transformer.h[0], m.transformer.h[0]],
            "units lists transformer.h.0 twice; list each module once",
        ),
        (
            lambda m: [m.transformer.h[0], m.transformer.h[0].attn],
            "units transformer.h.0 and transformer.h.0.attn are nested (the second is inside the first); list only one of them",
        ),
        (
            lambda m: instances_of(Gpt2Block, Conv1D),
            "units transformer.h.0 and transformer.h.0.attn.c_attn are nested (the second is inside the first); list only one of them",
        ),
        (
            lambda m: [nn.Linear(2, 2)],
            "units[0] (a Linear) is not a submodule of this Gpt2LMHead; pass modules of the model being sharded",
        ),
        (lambda m: [m], "units[0] is the model itself, which is the root"),
        (lambda m: [m.transformer.h[0].attn.bias], "units[0] is a Tensor; pass modules of the model"),
        (lambda m: m.transformer.h[0], "pass a list of modules or a policy"),
    ],
)
def test_a_unit_listed_twice_nested_or_foreign_is_refused_in_one_sentence(units, message):
    model = Gpt2LMHead(Gpt2Config())
    with pytest.raises(ValueError) as e:
        model_units(model, units(model))
    assert message in str(e.value) and "\n" not in str(e.value)
