"""What an fsdp1 record must show beyond its losses, shared by the fsdp1 engine's tests and `labkit compare`'s:
its bytes, calls and state as planned, and when each block's all-gather was issued."""

from __future__ import annotations

from collections import Counter

from labkit.engines import fsdp1
from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.probes.memory import STEP_SCALAR_BYTES, STEP_SCALARS


def assert_measured_is_planned(record: dict, cfg: RunConfig, n: int) -> None:
    """Bytes per collective = `predicted_wire_bytes`; calls per unit; state = the accounting, per term."""
    model = build_model(cfg.model)
    blocks = len(model.blocks)
    wire = {kind: row["wire_bytes"] for kind, row in record["comm"].items()}
    assert wire == fsdp1.predicted_wire_bytes(model, cfg, n)
    # One collective per unit and use: forward gathers the root and every block, backward each block again
    # (FULL_SHARD; none under SHARD_GRAD_OP), never the root; every unit is reduce-scattered once.
    gathers = blocks + 1 + (blocks if fsdp1.reshards(cfg) else 0)
    calls = Counter((c["kind"], c["group_size"]) for c in record["collective_calls"])
    assert calls == {("all_gather", n): gathers, ("reduce_scatter", n): blocks + 1}
    # On CPU FSDP1 gathers with the list form (`_all_gather_flat_param`: "HACK this should be handled by
    # C10D"), on CUDA with `all_gather_single`; the probe sees both, from Python.
    assert {c["function"] for c in record["collective_calls"]} == {"all_gather", "reduce_scatter_single"}
    assert record["state_bytes"] == fsdp1.state_bytes_accounting(model, cfg, n)
    # AdamW's step scalars, measured: the optimizer state beyond its two moments (each the flat shard's size)
    # is one 4-byte `step` per tensor AdamW updates, here one per flat parameter: one per unit.
    state = record["state_bytes"]
    step_scalars = fsdp1.state_bytes_by_term(model, cfg, n)[STEP_SCALARS]
    assert state["optimizer"] - 2 * state["params"] == step_scalars == STEP_SCALAR_BYTES * (blocks + 1)


def assert_prefetch(record: dict, cfg: RunConfig, n_blocks: int) -> None:
    """What the losses cannot see: when each block's all-gather was issued, in rank 0's last step.

    The loop's block spans start in the FSDP wrapper's pre-forward hook, before FSDP1 unshards inside its
    forward. forward_prefetch: block i's gather is issued by the unit before it, so before block i's span;
    without, inside it. Backward: block i-1's own pre-backward hook (on block i's input gradient) runs
    before the hook that ends block i's span, so without prefetch block i-1's gather lies at the end of
    block i's span; BACKWARD_PRE issues it one unit earlier, in block i's pre-backward, before that span.
    """
    last = max(e["step"] for e in record["timeline"])
    events = [e for e in record["timeline"] if e["rank"] == 0 and e["step"] == last]
    span = {e["name"]: e for e in events if e["kind"] == "compute"}
    gathers = sorted(e["start_s"] for e in events if e["kind"] == "comm" and e["name"] == "all_gather")
    forward, backward = gathers[1 : n_blocks + 1], gathers[n_blocks + 1 :]  # gathers[0]: the root
    ahead = [forward[i] < span[f"blocks.{i}.forward"]["start_s"] for i in range(n_blocks)]
    assert ahead == [cfg.prefetch] * n_blocks, ahead
    if fsdp1.reshards(cfg):  # backward gathers block n-1, n-2, ..., 0: block i-1's is backward[n - i]
        ahead = [backward[n_blocks - i] < span[f"blocks.{i}.backward"]["start_s"] for i in range(1, n_blocks)]
        assert ahead == [cfg.prefetch] * (n_blocks - 1), ahead
