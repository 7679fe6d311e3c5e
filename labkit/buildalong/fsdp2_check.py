"""The live check of notebook 05's build cell: the learner's own `fully_shard` calls, on real ranks.

`check_fully_shard(fn, world_size, model)` launches gloo ranks. Each builds the lab's model and hands it to the
learner's `fn(model, mesh, mp_policy)` (a 1-D mesh of every rank, a float32 `MixedPrecisionPolicy`), then trains
`steps` steps of it with the lab's AdamW under the probes. The parent prints one sentence per property: the
placements and FSDP units, the forward prefetch, the gradients after the first backward against `single`'s (AdamW
would hide a wrong scale from the losses), the losses against `single`, the wire bytes against the fsdp2 engine's
plan (`fsdp2.predicted_wire_bytes`). A mistake gets the sentence that names it, a stub its "write this
piece" sentence; nothing raises at the learner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from labkit.budget import padded_numel
from labkit.buildalong.stubs import raised, unwritten
from labkit.buildalong.verdicts import LOSS_RTOL, CheckResult, launched, names_of
from labkit.engines import fsdp2, on_rank
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.gradients import grads_mismatch, mean_hint, single_grads
from labkit.model import build_model
from labkit.names import ALL_GATHER
from labkit.probes import Probes

TIMEOUT_S = 120.0
# float32 weights and reductions: the learner's FSDP2 then computes what `single` computes (losses to float32
# rounding) and every all-gather carries 4 B per element, which the plan prices exactly. A bf16 policy would
# need a loss tolerance loose enough to hide a real mistake.
POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
PROPERTIES = ("placements", "prefetch", "gradients", "losses", "bytes")


def check_fully_shard(
    fn: Callable, world_size: int = 4, model: str = "tiny", steps: int = 3
) -> list[CheckResult]:
    """Run the learner's `fn(model, mesh, mp_policy)` on `world_size` ranks; one printed result per property."""
    return run_fully_shard_checks([fn], world_size, model, steps)[0]


def run_fully_shard_checks(
    fns: Sequence[Callable], world_size: int = 4, model: str = "tiny", steps: int = 3, quiet: bool = False
) -> list[list[CheckResult]]:
    """Several learners' functions in ONE launch, in order; each case's results printed unless `quiet`."""
    ranks, failed = launched(
        _rank_cases,
        world_size,
        list(fns),
        model,
        steps,
        timeout_s=TIMEOUT_S,
        question="does every rank make the same fully_shard calls?",
    )
    if ranks is None:
        cases = [[CheckResult("fully_shard", False, failed)] for _ in fns]
    else:
        cases = [_verdicts([r[i] for r in ranks], model, world_size) for i in range(len(fns))]
    if not quiet:
        for results in cases:
            for result in results:
                print(result)
    return cases


# ------------------------------------------------------------------------------------------------ ranks


def _rank_cases(fns: list[Callable], model: str, steps: int) -> list[dict]:
    torch.set_num_threads(1)  # one intra-op thread per rank, as the loop runs every engine
    return [_rank_case(fn, model, steps) for fn in fns]


def _rank_case(fn: Callable, model: str, steps: int) -> dict:
    """Shard a fresh model with the learner's `fn`, read what FSDP2 made of it, train it under the probes."""
    info = on_rank.rank_info()
    mesh = fsdp2.device_mesh(info.device.type, info.world_size)
    net = on_rank.rank_model(model, 0, info.device)
    try:
        fn(net, mesh, POLICY)
    except Exception as e:  # noqa: BLE001 - any mistake of theirs is reported, not raised
        return raised("your shard_with_fsdp2", e)
    facts = _layout(net, mesh)
    cfg = RunConfig(model=model, world_size=info.world_size, steps=steps)
    engine = fsdp2.Fsdp2Engine(net, fsdp2.sharded_adamw(net.parameters(), cfg), info.device)
    try:
        facts["grads"] = _first_gradients(engine, net, cfg, info)
    except Exception as e:  # noqa: BLE001
        return facts | {"training": raised("your sharded model's first backward", e)}
    with Probes(info.rank, info.device) as probes:
        facts["gathers_before_block"] = _watch_gathers(net, probes, last_step=steps - 1)
        try:
            facts["losses"] = on_rank.train_steps(engine, cfg, probes=probes)
        except Exception as e:  # noqa: BLE001
            return facts | {"training": raised("training your sharded model", e)}
    facts["comm"] = {k: row["wire_bytes"] for k, row in probes.comm.summary(steps - 1).items()}
    if info.rank == 0:
        oracle = SingleEngine(build_model(model), cfg, info.device)
        data = [on_rank.rank_batch(step, model, 0, 1, 0, info.device) for step in range(steps)]
        facts["oracle"] = [on_rank.timed_step(oracle, step, d)[0].item() for step, d in enumerate(data)]
    return facts


def _first_gradients(engine, net: torch.nn.Module, cfg: RunConfig, info) -> dict | None:
    """Rank 0's view of every parameter's whole gradient after step 0's forward and backward, before any
    optimizer step (a DTensor's shards gathered; a plain tensor's own, unreduced); the gradients then dropped,
    so training starts from none. None on the other ranks."""
    tokens, targets = on_rank.rank_batch(0, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
    engine.backward(engine.forward_loss(tokens, targets))
    grads = {}
    for name, p in net.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()  # a collective: every rank takes part
        grads[name] = None if g is None else g.detach().float().cpu().clone()
    net.zero_grad(set_to_none=True)
    return grads if info.rank == 0 else None


def _layout(net: torch.nn.Module, mesh) -> dict:
    """FSDP2's units (module -> its parameters' names), their policies and forward prefetch lists; each
    parameter's type and placements."""
    names = {id(p): name for name, p in net.named_parameters()}
    fsdp = {("root" if m is net else name): m for name, m in net.named_modules() if isinstance(m, FSDPModule)}
    states = {id(m._get_fsdp_state()): unit for unit, m in fsdp.items()}  # torch 2.13's private state
    units, policies, prefetch = {}, {}, {}
    for unit, module in fsdp.items():
        state = module._get_fsdp_state()
        units[unit] = [names[id(fp.sharded_param)] for g in state._fsdp_param_groups for fp in g.fsdp_params]
        policies[unit] = state._mp_policy == POLICY
        prefetch[unit] = [states.get(id(s), "?") for s in state._states_to_forward_prefetch]
    params = {  # name: (placements as text, or None for a plain tensor; on `mesh`)
        name: (str(p.placements), p.device_mesh == mesh) if isinstance(p, DTensor) else (None, False)
        for name, p in net.named_parameters()
    }
    return {"units": units, "policies": policies, "prefetch": prefetch, "params": params}


def _watch_gathers(net: torch.nn.Module, probes: Probes, last_step: int) -> list[list[int]]:
    """Per block, the payloads (bytes) of the all-gathers issued in `last_step` before the block computes.

    Registered after the learner's `fully_shard` (whose pre-forward hook FSDP2 prepends), so each list is
    read once FSDP2 has issued the block's own all-gather and any prefetch.
    """
    seen: list[list[int]] = [[] for _ in net.blocks]

    def before(i: int) -> None:
        if probes.timeline.step == last_step:
            seen[i] = [
                c.payload_bytes for c in probes.comm.calls if c.step == last_step and c.kind == ALL_GATHER
            ]

    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda _m, _a, i=i: before(i))
    return seen  # filled in place during the last step


# ------------------------------------------------------------------------------------------------ parent


def _verdicts(ranks: list[dict], model: str, n: int) -> list[CheckResult]:
    """One result per property from every rank's facts (rank 0's layout, losses and bytes speak for all)."""
    failed = next((r for r in ranks if "error" in r), None)
    if failed is not None:
        sentence = unwritten(failed["error"]) or (
            f"{failed['where']} raised {failed['error']}{failed['line']}"
        )
        return [CheckResult("fully_shard", False, sentence)]
    r = ranks[0]
    plan = _Plan(model, n)
    placements = _placements(r, plan)
    crashed = next((f["training"] for f in ranks if "training" in f), None)
    if crashed is None:
        return [placements, _prefetch(r, plan), _gradients(r, plan), _losses(r, plan), _bytes(r, plan)]
    because = "" if placements.ok else ", after the mistake above"
    sentence = f"{crashed['where']} raised {crashed['error']}{crashed['line']}{because}"
    return [placements, CheckResult("training", False, sentence)]


class _Plan:
    """What the fsdp2 engine's wrap gives the lab's model: its units, and its wire bytes per step."""

    def __init__(self, model: str, n: int):
        net = build_model(model)
        self.n = n
        self.blocks = len(net.blocks)
        in_blocks = {f"blocks.{i}.{k}" for i, b in enumerate(net.blocks) for k, _ in b.named_parameters()}
        self.units = {"root": [k for k, _ in net.named_parameters() if k not in in_blocks]} | {
            f"blocks.{i}": [f"blocks.{i}.{k}" for k, _ in b.named_parameters()]
            for i, b in enumerate(net.blocks)
        }
        self.block_payload = 4 * sum(padded_numel(tuple(p.shape), n) for p in net.blocks[0].parameters())
        self.wire = fsdp2.predicted_wire_bytes(net, RunConfig(model=model, world_size=n), n)
        self.grads = single_grads(RunConfig(model=model))


def _placements(r: dict, plan: _Plan) -> CheckResult:
    units, params = r["units"], r["params"]
    plain = [name for name, (placements, _) in params.items() if placements is None]
    off_mesh = [name for name, (placements, on_mesh) in params.items() if placements and not on_mesh]
    wrong = {
        name: placements
        for name, (placements, _) in params.items()
        if placements not in (None, str((Shard(0),)))
    }
    sentence = None
    if plain and set(plain) == set(plan.units["root"]):
        sentence = (
            f"{names_of(plain)} are plain tensors, whole on every rank and their gradients never averaged: the root "
            "is not sharded. Call fully_shard(model, ...) after the blocks, so the root's parameters form a unit too"
        )
    elif plain:
        sentence = f"{names_of(plain)} are plain tensors, not DTensors: no fully_shard call reached them"
    elif len(units) == 1:
        sentence = (
            f"one FSDP unit holds all {len(params)} parameters: the blocks have no FSDP state of their own, so the "
            "whole model is all-gathered at once before the first layer. Call fully_shard on each block, then "
            "on the root"
        )
    elif units != plan.units:
        missing = [u for u in plan.units if u not in units]
        sentence = f"your units are {names_of(units)}, not one per block plus the root" + (
            f" ({names_of(missing)} missing)" if missing else ""
        )
    elif off_mesh:
        sentence = (
            f"{names_of(off_mesh)} are sharded on another mesh than the one you were given: pass mesh=mesh"
        )
    elif wrong:
        name, placements = next(iter(wrong.items()))
        sentence = f"{name} is placed {placements}, not (Shard(dim=0),)"
    elif not all(r["policies"].values()):
        odd = [u for u, ok in r["policies"].items() if not ok]
        sentence = (
            f"{names_of(odd)} run with another MixedPrecisionPolicy than the mp_policy you were given: pass "
            "mp_policy=mp_policy to every fully_shard call"
        )
    if sentence:
        return CheckResult("placements", False, sentence, {"units": units})
    return CheckResult(
        "placements",
        True,
        f"all {len(params)} parameters are DTensors placed (Shard(dim=0),) on the {plan.n}-rank mesh; "
        f"{len(units)} FSDP units, one per block and the root's ({names_of(plan.units['root'])}), each with "
        "the policy you were given",
        {"units": units},
    )


def _prefetch(r: dict, plan: _Plan) -> CheckResult:
    lists = {u: r["prefetch"].get(u) for u in (f"blocks.{i}" for i in range(plan.blocks))}
    want = {f"blocks.{i}": [f"blocks.{i + 1}"] if i + 1 < plan.blocks else [] for i in range(plan.blocks)}
    early = [
        sum(p == plan.block_payload for p in seen) >= i + 2
        for i, seen in enumerate(r["gathers_before_block"][:-1])
    ]
    figures = {"lists": lists, "issued_before_previous_block": early}
    if all(v is None for v in lists.values()):
        sentence = "no block is an FSDP unit, so there is nothing to prefetch (see placements)"
    elif not any(lists.values()):
        sentence = (
            "no forward prefetch: no block names a module to all-gather early, so block i+1's all-gather starts "
            "only after block i has computed. Call set_modules_to_forward_prefetch([next block]) on each block "
            "but the last"
        )
    elif lists != want:
        odd = [f"{u} prefetches [{', '.join(v or [])}]" for u, v in lists.items() if v != want[u]]
        sentence = f"{names_of(odd)}: each block but the last should prefetch the next block, and only it"
    elif not all(early):
        late = early.index(False)
        sentence = (
            f"the prefetch lists are right, but blocks.{late + 1}'s all-gather was issued after blocks.{late} "
            "started computing on rank 0"
        )
    else:
        return CheckResult(
            "prefetch",
            True,
            f"each block all-gathers the next one during its own forward (blocks.0 -> blocks.1, ..., "
            f"blocks.{plan.blocks - 2} -> blocks.{plan.blocks - 1}): on rank 0 every block's all-gather was "
            "issued before the previous block computed",
            figures,
        )
    return CheckResult("prefetch", False, sentence, figures)


def _gradients(r: dict, plan: _Plan) -> CheckResult:
    got = {k: g for k, g in r["grads"].items() if g is not None}
    where = "rank 0's gradients after the first backward"
    hint = mean_hint(
        plan.n, "the ranks' gradients were summed, not averaged", "leave FSDP2's reduction as it is"
    )
    wrong = grads_mismatch(got, plan.grads, where, hint)
    if wrong is None:
        return CheckResult(
            "gradients",
            True,
            f"{where}, gathered whole, equal single's on the global batch for all {len(plan.grads)} parameters "
            "(the mean over the ranks' slices, before AdamW runs)",
        )
    plain = [name for name, (placements, _) in r["params"].items() if placements is None]
    because = (
        f"; {names_of(plain)} are plain tensors, so each rank keeps its own slice's gradient" if plain else ""
    )
    return CheckResult("gradients", False, wrong + because)


def _losses(r: dict, plan: _Plan) -> CheckResult:
    losses, single = r["losses"], r["oracle"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, single, strict=True)]
    figures = {"losses": losses, "single": single, "largest_rel_diff": max(diffs)}
    shown = f"losses {[round(x, 6) for x in losses]}, single {[round(x, 6) for x in single]}"
    if max(diffs) <= LOSS_RTOL:
        return CheckResult(
            "losses",
            True,
            f"{len(losses)} steps with the lab's AdamW: {shown}, largest relative difference {max(diffs):.1e} "
            f"(float32: at most {LOSS_RTOL:.0e})",
            figures,
        )
    first = next(i for i, d in enumerate(diffs) if d > LOSS_RTOL)
    plain = any(placements is None for placements, _ in r["params"].values())
    why = (
        "a plain parameter's gradient is not averaged over the ranks, so each copy learns from one rank's slice"
        if plain
        else "your sharded model does not compute what single computes"
    )
    return CheckResult(
        "losses",
        False,
        f"{shown}: they part from step {first} on (relative difference {diffs[first]:.1e}, allowed "
        f"{LOSS_RTOL:.0e}): {why}",
        figures,
    )


def _bytes(r: dict, plan: _Plan) -> CheckResult:
    got, want = r["comm"], plan.wire
    rows = ", ".join(f"{k} {got.get(k, 0):,} B (plan {want[k]:,} B)" for k in want)
    figures = {"measured": got, "plan": want}
    if got == want:
        return CheckResult(
            "bytes",
            True,
            f"per step on rank 0: {rows}, the fsdp2 engine's plan exactly: each unit all-gathered in forward, "
            "each block again in backward, each unit's gradients reduce-scattered once",
            figures,
        )
    return CheckResult(
        "bytes",
        False,
        f"per step on rank 0: {rows}: not the plan of one unit per block plus the root (see placements)",
        figures,
    )
