"""The live check of notebook 06's build cells: the learner's DeepSpeed config and training step, on real ranks.

`check_deepspeed(config_fn, step_fn, world_size, model, threshold)` reads the learner's
`config_fn(world_size, micro_batch, lab, threshold)` in the parent first (ZeRO stage, batch sizes, AdamW,
clipping: a wrong one is named before any rank starts). Then gloo ranks hand it, at threshold 0 and at
`threshold`, to the deepspeed engine's own `deepspeed.initialize` (`labkit.engines.deepspeed.initialize`) and
train `steps` steps with the learner's `step_fn(engine, tokens, targets)` under the probes. One sentence per
property: the config, the threshold DeepSpeed applied (which parameters stayed whole), the gradients DeepSpeed
holds when the learner's first `engine.step()` starts against `single`'s (AdamW would hide a wrong scale from the
losses), the losses against `single`, the wire bytes of the last step against the engine's plan
(`deepspeed.zero3_wire_bytes`). A mistake gets the
sentence that names it, a stub its "write this piece" sentence; nothing raises at the learner.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from labkit.buildalong.stubs import raised, unwritten
from labkit.buildalong.verdicts import LOSS_RTOL, CheckResult, launched
from labkit.engines import deepspeed as ds_engine
from labkit.engines import on_rank
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.gradients import grads_mismatch, mean_hint, single_grads
from labkit.model import build_model
from labkit.model import config as model_config
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.probes import Probes

TIMEOUT_S = 300.0  # a DeepSpeed start costs seconds per rank on a loaded laptop
PROPERTIES = ("config", "threshold", "gradients", "losses", "bytes")
STAGES = {
    0: "stage 0 (DeepSpeed's default without a zero_optimization section) is no ZeRO: every rank keeps the whole "
    "model, its gradients and AdamW's state",
    1: "stage 1 partitions only AdamW's state: every rank keeps all the weights and gradients",
    2: "stage 2 partitions gradients and AdamW's state, but every rank still keeps all the weights",
}


def check_deepspeed(
    config_fn: Callable,
    step_fn: Callable,
    world_size: int = 2,
    model: str = "tiny",
    threshold: int = 1000,
    steps: int = 3,
) -> list[CheckResult]:
    """Train with the learner's config and step on `world_size` ranks; one printed result per property."""
    return run_deepspeed_checks([(config_fn, step_fn)], world_size, model, threshold, steps)[0]


def run_deepspeed_checks(
    cases: Sequence[tuple[Callable, Callable]],
    world_size: int = 2,
    model: str = "tiny",
    threshold: int = 1000,
    steps: int = 3,
    quiet: bool = False,
) -> list[list[CheckResult]]:
    """Several (config_fn, step_fn) cases, the ranks of all of them in ONE launch; each case's results printed
    unless `quiet`."""
    if steps < 2:
        raise ValueError(
            f"steps={steps}: pass steps>=2 (the gradients are read in the first step, the bytes in the last)"
        )
    thresholds = (0, threshold)
    lab = RunConfig(model=model, world_size=world_size, steps=steps)
    micro_batch = model_config(model).global_batch // world_size
    results: list[list[CheckResult]] = [[] for _ in cases]
    ready = []  # (case index, its config per threshold, its config sentence, step_fn)
    for i, (config_fn, step_fn) in enumerate(cases):
        configs, said = _read_configs(config_fn, world_size, micro_batch, lab, thresholds)
        if said.ok:
            ready.append((i, configs, said, step_fn))
        else:
            results[i] = [said]
    if ready:
        ranks, failed = launched(
            _rank_cases,
            world_size,
            [(c, fn) for _, c, _, fn in ready],
            model,
            steps,
            timeout_s=TIMEOUT_S,
            question="does train_step do the same on every rank?",
        )
        for j, (i, configs, said, _) in enumerate(ready):
            if ranks is None:
                results[i] = [CheckResult("train_step", False, failed)]
                continue
            runs = [[r["cases"][j][k] for r in ranks] for k in range(len(thresholds))]
            results[i] = [said, *_verdicts(runs, ranks[0]["oracle"], configs, thresholds, model, world_size)]
    if not quiet:
        for case in results:
            for result in case:
                print(result)
    return results


# ------------------------------------------------------------------------------------------------ parent: config


def _read_configs(
    config_fn, n: int, micro_batch: int, lab: RunConfig, thresholds
) -> tuple[list, CheckResult]:
    """The learner's config at each threshold, and the config's result (a mistake stops the check here)."""
    configs = []
    for threshold in thresholds:
        try:
            configs.append(config_fn(n, micro_batch, lab, threshold))
        except Exception as e:  # noqa: BLE001 - any mistake of theirs is reported, not raised
            raised = _raised("zero3_config", e)
            said = unwritten(e) or f"{raised['where']} raised {raised['error']}{raised['line']}"
            return [], CheckResult("config", False, said)
    for config in configs:
        mistake = _config_mistake(config, n, micro_batch, lab)
        if mistake:
            return [], CheckResult("config", False, mistake)
    said = (
        f"stage 3; train_batch_size {micro_batch * n} = {micro_batch} sequences per rank x {n} ranks, one "
        f"micro-batch per step; AdamW with the lab's lr {lab.lr:g}, betas {lab.betas}, eps {lab.eps:g} and "
        f"weight decay {lab.weight_decay:g}; no gradient clipping, float32"
    )
    return configs, CheckResult("config", True, said)


def _config_mistake(config: Any, n: int, micro_batch: int, lab: RunConfig) -> str | None:
    """The sentence naming the first thing wrong in a config for this run, in the order DeepSpeed reads it."""
    if not isinstance(config, dict):
        return f"zero3_config returned a {type(config).__name__}, not a dict: return DeepSpeed's config as a dict"
    zero = config.get("zero_optimization")
    stage = ds_engine.zero_knob(zero if isinstance(zero, dict) else {}, "stage")
    if stage != 3:
        return f"{STAGES.get(stage, f'stage {stage} is no ZeRO stage')}; ZeRO-3, which partitions the weights too, is stage 3"
    if any(
        isinstance(config.get(dtype), dict) and config[dtype].get("enabled") for dtype in ("bf16", "fp16")
    ):
        return "this check compares with single in float32: leave bf16 and fp16 off"
    return (
        _batch_mistake(config, n, micro_batch) or _optimizer_mistake(config, lab) or _clipping_mistake(config)
    )


def _batch_mistake(config: dict, n: int, micro_batch: int) -> str | None:
    micro, total = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if micro is None and total is None:
        return (
            "no batch size: say how many sequences each rank takes per step (train_micro_batch_size_per_gpu) "
            "and the global batch they make (train_batch_size)"
        )
    if accumulation != 1:
        return (
            f"gradient_accumulation_steps={accumulation}: DeepSpeed would step the optimizer once every "
            f"{accumulation} micro-batches, and train_step is one step per micro-batch; leave it at 1"
        )
    if micro is not None and micro != micro_batch:
        return f"train_micro_batch_size_per_gpu={micro}, but each rank takes {micro_batch} sequences per step (micro_batch)"
    if total is not None and total != micro_batch * n:
        return (
            f"train_batch_size={total}, but {micro_batch} sequences per rank x {n} ranks x 1 micro-batch per step "
            f"make {micro_batch * n}: DeepSpeed requires train_batch_size = micro batch x accumulation steps x "
            "world size"
        )
    return None


def _optimizer_mistake(config: dict, lab: RunConfig) -> str | None:
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    section = config.get("optimizer")
    if not isinstance(section, dict):
        return (
            "no optimizer section: deepspeed.initialize gets no optimizer here, so the config must name one; "
            "name AdamW with the lab's hyper-parameters"
        )
    kind, params = str(section.get("type", "")).lower(), section.get("params") or {}
    # DeepSpeed's "Adam" decouples the weight decay (AdamW) unless adam_w_mode is False.
    if kind != "adamw" and not (kind == "adam" and params.get("adam_w_mode", ADAM_W_MODE_DEFAULT)):
        return f'optimizer type {section.get("type")!r}: single trains with AdamW; name "AdamW"'
    want = {"lr": lab.lr, "betas": tuple(lab.betas), "eps": lab.eps, "weight_decay": lab.weight_decay}
    for key, value in want.items():
        got = params.get(key)
        same = got is not None and (
            isinstance(got, (list, tuple)) and tuple(got) == value if key == "betas" else got == value
        )
        if not same:
            given = "missing (the optimizer's own default then)" if got is None else f"{got}"
            return f"optimizer params {key} {given}, but the lab's AdamW has {key} {value}: take it from lab.{key}"
    return None


def _clipping_mistake(config: dict) -> str | None:
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    clip = config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if clip == 0:
        return None
    default = " (DeepSpeed's default when the key is missing)" if "gradient_clipping" not in config else ""
    return (
        f"gradient_clipping {clip}{default}: DeepSpeed would scale the gradients down whenever their global norm "
        "is above it, single never does, and the lab's curve would bend away from single's; set it to 0.0"
    )


# ------------------------------------------------------------------------------------------------ ranks


def _rank_cases(cases: list[tuple[list[dict], Callable]], model: str, steps: int) -> dict:
    """Rank side: each case at each of its configs (a fresh model each), then single's losses on rank 0."""
    torch.set_num_threads(1)  # one intra-op thread per rank, as the loop runs every engine
    info = on_rank.rank_info()
    step_ids = itertools.count()  # each step of each run its own tag in the probe
    # Installed before DeepSpeed's first start: its backend keeps the collective functions it finds then.
    with Probes(info.rank, info.device) as probes:
        out = [[_rank_run(c, fn, model, steps, probes, step_ids) for c in configs] for configs, fn in cases]
    single = None
    if info.rank == 0:
        oracle = SingleEngine(build_model(model), RunConfig(model=model, steps=steps), info.device)
        data = [on_rank.rank_batch(step, model, 0, 1, 0, info.device) for step in range(steps)]
        single = [on_rank.timed_step(oracle, step, d)[0].item() for step, d in enumerate(data)]
    return {"cases": out, "oracle": single}


def _rank_run(
    config: dict, step_fn: Callable, model: str, steps: int, probes: Probes, step_ids: Iterator[int]
) -> dict:
    """Start DeepSpeed with the learner's config, read what it applied, train `steps` steps with their step."""
    info = on_rank.rank_info()
    try:
        engine = ds_engine.initialize(on_rank.rank_model(model, 0, info.device), config).engine
    except Exception as e:  # noqa: BLE001
        return _raised("deepspeed.initialize with your config", e)
    calls = _count_calls(engine, ("backward", "step"))
    facts: dict[str, Any] = {
        "grads": _grads_at_first_step(engine),
        "persistent": {name: bool(p.ds_persist) for name, p in engine.module.named_parameters()},
        "threshold": engine.zero_param_persistence_threshold(),
        "losses": [],
        "calls": calls,
    }
    for step in range(steps):
        tokens, targets = on_rank.rank_batch(step, model, 0, info.world_size, info.rank, info.device)
        with probes.step(last := next(step_ids)):
            try:
                loss = step_fn(engine, tokens, targets)
            except Exception as e:  # noqa: BLE001
                return facts | _raised(f"your train_step (step {step})", e)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return facts | {
                "error": f"it returned {type(loss).__name__}, not the loss",
                "where": "your train_step",
            }
        mean = loss.detach().float().reshape(()).clone()
        dist.all_reduce(mean)  # outside the probed step
        facts["losses"].append(mean.item() / info.world_size)
    facts["comm"] = {kind: row["wire_bytes"] for kind, row in probes.comm.summary(last).items()}
    return facts


def _grads_at_first_step(engine) -> dict[str, torch.Tensor | None]:
    """{name: whole gradient}, filled in when the learner's first `engine.step()` starts, before AdamW runs:
    DeepSpeed's own `safe_get_full_grad` (a collective under ZeRO-3, so every rank reads; rank 0 keeps them)."""
    from deepspeed.utils import safe_get_full_grad

    grads: dict[str, torch.Tensor | None] = {}
    step = engine.step

    def read_then_step(*args, **kwargs):
        if not grads:
            for name, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                grads[name] = None if g is None else g.detach().float().cpu().clone()
            if dist.get_rank() != 0:
                grads.update(dict.fromkeys(grads))  # read, but only rank 0's travel back
        return step(*args, **kwargs)

    engine.step = read_then_step
    return grads


def _raised(where: str, e: BaseException) -> dict[str, str]:
    import deepspeed

    return raised(where, e, deepspeed)


def _count_calls(engine: torch.nn.Module, names: Sequence[str]) -> dict[str, int]:
    """Count the learner's calls of the engine's methods `names` (the dict fills in as they are called)."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        method = getattr(engine, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)

        setattr(engine, name, counted)
    return counts


# ------------------------------------------------------------------------------------------------ parent: verdicts


def _verdicts(runs, single, configs, thresholds, model: str, n: int) -> list[CheckResult]:
    """The threshold, losses and bytes results from every rank's facts of each run (one run per threshold)."""
    for ranks in runs:
        failed = next((r for r in ranks if "error" in r), None)
        if failed is not None:
            sentence = unwritten(failed["error"]) or (
                f"{failed['where']} raised {failed['error']}{failed.get('line', '')}"
            )
            return [CheckResult("train_step", False, sentence)]
    facts = [ranks[0] for ranks in runs]
    numels = {name: p.numel() for name, p in build_model(model).named_parameters()}
    return [
        _threshold(facts, thresholds, numels),
        _gradients(facts, thresholds, model, n),
        _losses(facts, thresholds, single),
        _bytes(facts, thresholds, configs, model, n),
    ]


def _threshold(facts, thresholds, numels: dict[str, int]) -> CheckResult:
    largest = max(numels.values())
    for f, asked in zip(facts, thresholds, strict=True):
        want = {name: ds_engine.is_persistent(numel, asked) for name, numel in numels.items()}
        if f["persistent"] == want:
            continue
        applied, whole = f["threshold"], sum(f["persistent"].values())
        default = ds_engine.zero_knob({}, "stage3_param_persistence_threshold")
        why = (
            " (DeepSpeed's default: the key is missing, or not inside zero_optimization)"
            if applied == default
            else ""
        )
        if whole == len(numels):
            sentence = (
                f"at threshold {asked} all {whole} parameters stayed whole on every rank, so ZeRO-3 partitioned "
                f"none: DeepSpeed applied stage3_param_persistence_threshold={applied:,}{why}, above the largest "
                f"parameter's {largest:,} elements"
            )
        else:
            sentence = (
                f"at threshold {asked} {whole} parameters stayed whole on every rank, where {sum(want.values())} "
                f"have at most {asked} elements: DeepSpeed applied stage3_param_persistence_threshold={applied:,}{why}"
            )
        return CheckResult(
            "threshold",
            False,
            f"{sentence}; put `threshold` there, in zero_optimization",
            {"applied": applied},
        )
    kept = sum(ds_engine.is_persistent(numel, thresholds[-1]) for numel in numels.values())
    return CheckResult(
        "threshold",
        True,
        f"DeepSpeed applied thresholds {thresholds[0]} and {thresholds[-1]}: at {thresholds[0]} all {len(numels)} "
        f"parameters are partitioned; at {thresholds[-1]} the {kept} with at most {thresholds[-1]} elements stayed "
        f"whole on every rank and the {len(numels) - kept} larger ones are partitioned",
    )


def _gradients(facts, thresholds, model: str, n: int) -> CheckResult:
    want = single_grads(RunConfig(model=model))
    hint = mean_hint(
        1 / n,
        "the mean was taken twice",
        "engine.backward(loss) averages over the ranks itself: pass it the loss",
    )
    for f, threshold in zip(facts, thresholds, strict=True):
        if not f["grads"]:
            sentence = (
                "no gradient was read: train_step never called engine.step(), where DeepSpeed's are read"
            )
            return CheckResult("gradients", False, sentence)
        got = {k: g for k, g in f["grads"].items() if g is not None}
        wrong = grads_mismatch(
            got, want, f"at threshold {threshold}, the gradients before the first step", hint
        )
        if wrong:
            return CheckResult("gradients", False, wrong)
    return CheckResult(
        "gradients",
        True,
        f"at each threshold the gradients DeepSpeed held when engine.step() began (safe_get_full_grad, gathered "
        f"whole) equal single's on the global batch for all {len(want)} parameters: the mean over the ranks",
    )


def _shown(losses: Sequence[float]) -> list[float]:
    return [round(x, 5) for x in losses]


def _losses(facts, thresholds, single: list[float]) -> CheckResult:
    for f, threshold in zip(facts, thresholds, strict=True):
        diffs = [abs(a - b) / abs(b) for a, b in zip(f["losses"], single, strict=True)]
        if max(diffs) <= LOSS_RTOL:
            continue
        first = next(i for i, d in enumerate(diffs) if d > LOSS_RTOL)
        pair = f"losses {_shown(f['losses'])}, single's {_shown(single)}"
        if f["calls"]["step"] == 0:
            sentence = (
                f"engine.step() was never called: AdamW never updated the partitions, so the {pair} part at step "
                f"{first}. End train_step with engine.step()"
            )
        elif f["calls"]["backward"] == 0:
            sentence = f"engine.backward(loss) was never called, and the {pair} part at step {first}"
        else:
            sentence = (
                f"at threshold {threshold} the {pair} part at step {first} (relative difference {diffs[first]:.1e}, "
                f"float32 allows {LOSS_RTOL:.0e})"
            )
        return CheckResult("losses", False, sentence, {"losses": f["losses"], "single": single})
    worst = max(abs(a - b) / abs(b) for f in facts for a, b in zip(f["losses"], single, strict=True))
    note = ""
    if facts[0]["calls"]["backward"] == 0:
        # DeepSpeed 0.19.8 hooks the loss's own backward (`_support_torch_style_backward` in its engine.py).
        note = (
            "; you called loss.backward(): DeepSpeed 0.19.8 hooks it and does what engine.backward(loss) does, "
            "but without those hooks (an older torch, or ZeRO stage 0) it raises; engine.backward(loss) always works"
        )
    return CheckResult(
        "losses",
        True,
        f"{len(single)} steps at each threshold: losses {_shown(facts[-1]['losses'])} = single's {_shown(single)} "
        f"(largest relative difference {worst:.1e}; float32 allows {LOSS_RTOL:.0e}){note}",
        {"losses": [f["losses"] for f in facts], "single": single},
    )


def _bytes(facts, thresholds, configs, model: str, n: int) -> CheckResult:
    net = build_model(model)
    rows = []
    for f, asked, config in zip(facts, thresholds, configs, strict=True):
        got = {k: f["comm"].get(k, 0) for k in (ALL_GATHER, REDUCE_SCATTER)}
        measured = f"all-gather {got[ALL_GATHER]:,} B, reduce-scatter {got[REDUCE_SCATTER]:,} B"
        zero = {**config["zero_optimization"], "stage3_param_persistence_threshold": asked}
        try:
            plan = ds_engine.zero3_wire_bytes(net, zero, n)
        except ValueError as e:
            sentence = (
                f"at threshold {asked} rank 0 sent {measured} in the last step, and {e}: release each parameter "
                "after use (stage3_max_reuse_distance 0) and prefetch nothing (stage3_prefetch_bucket_size 0)"
            )
            return CheckResult("bytes", False, sentence, {"measured": got})
        if got != plan:
            sentence = (
                f"at threshold {asked} rank 0 sent {measured} in the last step, where the plan says all-gather "
                f"{plan[ALL_GATHER]:,} B, reduce-scatter {plan[REDUCE_SCATTER]:,} B"
            )
            return CheckResult("bytes", False, sentence, {"measured": got, "plan": plan})
        rows.append(f"at {asked}, {measured}")
    return CheckResult(
        "bytes",
        True,
        f"rank 0 in the last step: {'; '.join(rows)}: the deepspeed engine's plan exactly (a parameter kept whole "
        "gathered once per step, after the optimizer step; every other one twice, for forward and for backward; "
        "each gradient reduce-scattered once)",
    )
