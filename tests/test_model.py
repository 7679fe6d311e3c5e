"""The lab's model and data: deterministic, world-size independent, shaped for even and uneven shards."""

import pytest
import torch

from labkit.model import CONFIGS, batch, build_model, count_params, loss_fn


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = build_model("tiny", seed=0), build_model("tiny", seed=0), build_model("tiny", seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name


def test_sizes_tiny_under_a_million_small_between_10_and_30_million():
    assert 100_000 < count_params(build_model("tiny")) < 1_000_000
    assert 10_000_000 < count_params(build_model("small")) < 30_000_000


def test_tiny_shards_evenly_on_2_3_4_ranks_and_tiny_uneven_does_not():
    even = build_model("tiny")
    assert all(p.shape[0] % 12 == 0 for p in even.parameters())
    uneven = build_model("tiny_uneven")
    dims = [p.shape[0] for p in uneven.parameters()]
    assert any(d % 3 for d in dims) and any(d % 4 for d in dims)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_global_batch_is_the_same_whatever_the_world_size(name):
    tokens, targets = batch(3, name, seed=5)
    assert tokens.shape == (CONFIGS[name].global_batch, CONFIGS[name].seq_len)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    for n in (2, 3, 4):
        parts = [batch(3, name, seed=5, world_size=n, rank=r) for r in range(n)]
        assert torch.equal(torch.cat([p[0] for p in parts]), tokens)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    assert not torch.equal(batch(4, name, seed=5)[0], tokens)


def test_batch_rejects_a_world_size_that_does_not_divide_the_global_batch():
    with pytest.raises(ValueError, match="world_size=5 does not divide"):
        batch(0, "tiny", world_size=5, rank=0)
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        build_model("huge")


def test_the_loss_falls_when_trained():
    torch.manual_seed(0)
    model = build_model("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(15):
        tokens, targets = batch(step, "tiny")
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
