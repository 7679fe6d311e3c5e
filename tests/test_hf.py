"""Hugging Face Transformers models (labkit.hf): any output a unit returns through the scratch engine's and
the build-along's hooks, the issue's GPT2LMHeadModel sharded by `instances_of(GPT2Block)`, and every engine
on a small GPT-2 (tied embeddings) and a small Llama at 2, 3 and 4 ranks against `single`, each engine's
byte plan and its own state accounting. One launch per world size serves every engine and both models, and
at 2 ranks the hand-written checks above them too; one launch of `single` serves both models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from engine_helpers import assert_close
from launches import job, launched_on_demand, train
from torch import nn

from labkit.engines.base import RunConfig
from labkit.engines.loop import run_many
from labkit.model import batch, build_model, loss_fn

HF_MODELS = ("hf-gpt2", "hf-llama")
ENGINES = ("ddp", "scratch", "fsdp1", "fsdp2", "deepspeed")
PREFETCHING = ("scratch", "fsdp1", "fsdp2")  # the engines that read RunConfig.prefetch


# ------------------------------------------------------------------- any output, through the scratch hooks


@dataclasses.dataclass
class Out:  # a ModelOutput-like dataclass
    hidden: torch.Tensor
    extra: str = "not a tensor"


class Layer(nn.Module):
    """A residual MLP whose output comes back in the shape `kind` names (tensor, tuple, dict, dataclass)."""

    def __init__(self, width: int, kind: str):
        super().__init__()
        self.fc, self.kind = nn.Linear(width, width), kind

    def forward(self, x, *, scale: float = 1.0):
        y = x + scale * torch.tanh(self.fc(x))
        return {
            "tensor": y,
            "tuple": (y, y.detach() * 0, None),
            "dict": {"h": y, "n": 3},
            "dataclass": Out(y),
        }[self.kind]


class Net(nn.Module):
    """Embedding, one layer of each output kind, a head; called with keyword inputs, returns a dict."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 10)
        self.layers = nn.ModuleList(Layer(10, k) for k in ("tensor", "tuple", "dict", "dataclass"))
        self.head = nn.Linear(10, 13)

    def forward(self, *, input_ids, scale=0.5):
        x = self.emb(input_ids)
        for layer in self.layers:
            out = layer(x, scale=scale)
            x = {
                "tensor": lambda o: o,
                "tuple": lambda o: o[0],
                "dict": lambda o: o["h"],
                "dataclass": lambda o: o.hidden,
            }[layer.kind](out)
        return {"logits": self.head(x), "hidden": x}


def _any_output() -> dict:
    from labkit.units import instances_of
    from labkit.zero import ZeRO3

    rank, n = dist.get_rank(), dist.get_world_size()
    tokens = torch.randint(13, (4 * n, 6), generator=torch.Generator().manual_seed(1))
    oracle, net = Net(), Net()
    zero = ZeRO3(net, units=instances_of(Layer))
    opt_single = torch.optim.SGD(oracle.parameters(), lr=0.1)
    opt = torch.optim.SGD(zero.trainable_shards(), lr=0.1)
    losses = []
    for _ in range(2):
        ref = loss_fn(oracle(input_ids=tokens)["logits"], tokens)
        ref.backward()
        opt_single.step()
        opt_single.zero_grad()
        mine = tokens[rank * 4 : (rank + 1) * 4]
        loss = loss_fn(net(input_ids=mine)["logits"], mine)
        loss.backward()
        zero.finish_backward()
        opt.step()
        dist.all_reduce(loss)
        losses.append((loss.item() / n, ref.item()))
    held = {}
    for mode in ("no_grad", "eval"):
        if mode == "eval":
            net.eval()
            net(input_ids=tokens[:2])  # autograd on, but an eval forward has no backward after it
        else:
            with torch.no_grad():
                net(input_ids=tokens[:2])
        held[mode] = sum(p.untyped_storage().nbytes() for p in net.parameters())
    return {"losses": losses, "held": held}


def test_units_returning_tensors_tuples_dicts_and_dataclasses_train_like_single_and_leave_nothing_gathered(
    ranks,
):
    for r in ranks(2)["any output"]:
        for mine, ref in r["losses"]:
            assert mine == pytest.approx(ref, rel=1e-5)
        assert r["held"] == {"no_grad": 0, "eval": 0}  # a forward with no backward keeps only the shards


# ------------------------------------------------ the issue's case: GPT2LMHeadModel, its own blocks as units


def _gpt2_lm_head_model(pieces) -> dict:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from labkit.buildalong import attach
    from labkit.units import instances_of
    from labkit.zero import ZeRO3

    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for engine in ("scratch", "learner"):
        hf, oracle = build_model("hf-gpt2").hf, build_model("hf-gpt2").hf
        tokens, targets = batch(0, "hf-gpt2")
        ref = oracle(input_ids=tokens, labels=tokens).loss  # a CausalLMOutputWithCrossAttentions, its loss
        ref.backward()
        want = {name: p.grad for name, p in oracle.named_parameters()}
        if engine == "scratch":
            zero = ZeRO3(hf, units=instances_of(GPT2Block))
        else:
            units = attach(hf, pieces, units=instances_of(GPT2Block))
        per = len(tokens) // n
        mine = tokens[rank * per : (rank + 1) * per]
        loss = hf(input_ids=mine, labels=mine).loss
        loss.backward()
        if engine == "scratch":
            zero.finish_backward()
            shards = dict(zero.named_shards())
        else:
            prefix = {id(p): f"{u.name}." if u.name != "root" else "" for u in units for p in u.params}
            names = {id(p): name for name, p in hf.named_parameters()}
            shards = {
                prefix[id(p)] + names[id(p)].removeprefix(prefix[id(p)]): s
                for u in units
                for p, s in zip(u.params, u.shards, strict=True)
            }
        from labkit.zero.sharding import shard_dim0

        worst = max(
            float((s.grad - shard_dim0(want[name], rank, n)).abs().max()) / float(want[name].abs().max())
            for name, s in shards.items()
        )
        dist.all_reduce(loss)
        out[engine] = {"loss": loss.item() / n, "single": ref.item(), "worst_grad": worst}
    return out


def test_the_issues_gpt2_lm_head_model_shards_by_its_own_blocks_with_ours_and_the_learners_zero3(ranks):
    for r in ranks(2)["gpt2 lm head"]:
        for engine, got in r.items():
            assert got["loss"] == pytest.approx(got["single"], rel=1e-5), engine
            assert got["worst_grad"] < 1e-4, engine


# ------------------------------------------------------------- every engine, both models, 2, 3 and 4 ranks


STEPS = 3  # DeepSpeed traces its order over the first two steps: the third is its steady one
# DeepSpeed (the slowest to start) and DDP at 2 ranks; the sharding engines at 2, 3 (prefetch off) and 4
AT = {2: ENGINES, 3: PREFETCHING, 4: PREFETCHING}


@pytest.fixture(scope="module")
def singles() -> dict[str, list[float]]:
    """`single`'s losses per model: the global batch, whatever the world size (one run serves 2, 3, 4); both
    models in one launch."""
    records = run_many([("single", RunConfig(model=m, steps=STEPS)) for m in HF_MODELS])
    return {m: rec["losses"] for m, rec in zip(HF_MODELS, records, strict=True)}


def engine_runs(n: int) -> list[tuple[str, RunConfig]]:
    """Every engine of AT[n] on both models; at 3 ranks the prefetching engines run with prefetch off."""
    return [
        (e, RunConfig(model=m, world_size=n, steps=STEPS, prefetch=not (n == 3 and e in PREFETCHING)))
        for m in HF_MODELS
        for e in AT[n]
    ]


def hf_jobs(n: int) -> dict:
    """Every rank-side job of this file at `n` ranks, in launch order: at 2, the hand-written checks first."""
    jobs = {}
    if n == 2:
        from labkit.buildalong.cells import pieces_from_notebook

        jobs["any output"] = job(_any_output, per_rank=True)
        jobs["gpt2 lm head"] = job(_gpt2_lm_head_model, pieces_from_notebook(), per_rank=True)
    for engine, cfg in engine_runs(n):
        jobs[engine, cfg.model] = train(engine, cfg)
    return jobs


@pytest.fixture(scope="module")
def ranks():
    """`get(n)`: {job name, or (engine, model): result} of `hf_jobs(n)`, launched the first time a test asks."""
    return launched_on_demand(hf_jobs)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_engine_on_hugging_face_models_matches_single_its_plan_and_its_accounting(n, ranks, singles):
    from labkit.engines import deepspeed, fsdp1, fsdp2, scratch

    launched = ranks(n)
    out = {(e, cfg.model): (cfg, launched[e, cfg.model]) for e, cfg in engine_runs(n)}
    accounting = {
        scratch: scratch.state_bytes_accounting,
        fsdp1: fsdp1.state_bytes_accounting,
        fsdp2: fsdp2.state_bytes_accounting,
        deepspeed: deepspeed.accounted_state_bytes,
    }
    for m in HF_MODELS:
        model = build_model(m)
        for e in {e for e, model_name in out if model_name == m}:
            assert_close(out[e, m][1]["losses"], singles[m], rel=1e-4)
        for engine, accounted in accounting.items():
            if (engine.NAME, m) not in out:
                continue
            cfg, record = out[engine.NAME, m]
            wire = {k: row["wire_bytes"] for k, row in record["comm"].items() if k != "all_reduce"}
            assert wire == engine.predicted_wire_bytes(model, cfg, n), (engine.NAME, m, n)
            assert record["state_bytes"] == accounted(model, cfg, n), (engine.NAME, m, n)


@pytest.mark.fast  # builds the models in this process
def test_gpt2_ties_its_head_to_the_token_embedding_and_every_engine_counts_it_once():
    gpt2, llama = build_model("hf-gpt2"), build_model("hf-llama")
    assert gpt2.hf.lm_head.weight is gpt2.hf.transformer.wte.weight
    assert llama.hf.lm_head.weight is not llama.hf.model.embed_tokens.weight
    assert [type(b).__name__ for b in (gpt2.blocks[0], llama.blocks[0])] == ["GPT2Block", "LlamaDecoderLayer"]
    assert {n for n, _ in llama.named_buffers()} >= {"hf.model.rotary_emb.inv_freq"}
    # tied: one parameter, so 16 B per element once in single's state, as every engine's plan counts it
    assert sum(p.numel() for p in gpt2.parameters()) == sum(
        p.numel() for n, p in gpt2.named_parameters(remove_duplicate=False) if n != "hf.lm_head.weight"
    )
