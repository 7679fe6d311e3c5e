"""Exercise 05: DeepSpeed configs for ZeRO-3 offload and for ZeRO++, validated by DeepSpeed's own parser.

`parse` (labkit.grading.public: the student release's check() uses it too) runs `deepspeed.runtime.config.DeepSpeedConfig(config)` as it would run on `world_size` ranks:
without a process group the parser assumes one rank, so its two questions to `deepspeed.comm` (this rank,
how many ranks) are answered for the duration of the call. Everything else (unknown keys, types, enums,
the batch identity train = micro x accumulation x ranks) is DeepSpeed's own validation.
"""

from __future__ import annotations

import json

from labkit.errors import error_text
from labkit.grading.kit import Check, Exercise, answer, draw_where, rng, tally
from labkit.grading.public import parse

OFFLOAD = ("offload_config",)


FIXED = (4, 2, 8)  # (world_size, micro_batch, gpus_per_node): 4 ranks on one node of 8


def _apart(case: tuple[int, int, int]) -> bool:
    """Several whole nodes, and no size (nor the train batch) the fixed case has: a number typed in shows."""
    n, micro, gpn = case
    return n > gpn and n % gpn == 0 and micro * n != FIXED[0] * FIXED[1]


def _cases(seed: int) -> list[tuple[int, int, int]]:
    """(world_size, micro_batch, gpus_per_node): FIXED, then one drawn on several nodes (`_apart`)."""
    r = rng(seed, "configs")
    drawn = draw_where(r, lambda r: (r.choice([8, 16]), r.choice([1, 3, 4]), r.choice([2, 4])), _apart)
    return [FIXED, drawn]


def _json_dict(value) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"the config must be a dict, got {type(value).__name__}")
    return json.loads(json.dumps(value))


def _offload_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "offload_config")
    return [_json_dict(fn(n, micro)) for n, micro, _ in _cases(seed)]


def _zeropp_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "zeropp_config")
    return [_json_dict(fn(n, gpn, micro)) for n, micro, gpn in _cases(seed)]


def _parsed(configs: list, seed: int) -> list[tuple[tuple[int, int, int], object, str]]:
    """(case, parsed config or None, DeepSpeed's complaint) for every case."""
    out = []
    for case, config in zip(_cases(seed), configs, strict=True):
        try:
            out.append((case, parse(config, case[0]), ""))
        except Exception as e:  # noqa: BLE001 (DeepSpeed raises assertion, pydantic and value errors)
            out.append((case, None, error_text(e)))
    return out


def _accepted_judge(got: list, seed: int) -> tuple[float, str]:
    return tally(
        [(p is not None, f"world_size={c[0]}: DeepSpeed says {why}") for c, p, why in _parsed(got, seed)]
    )


def _device(section) -> str:
    device = getattr(section, "device", None) if section is not None else None
    return str(getattr(device, "value", device))


def _offload_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (n, _, _), p, why in _parsed(got, seed):
        if p is None:
            cases.append((False, f"world_size={n}: not parsed ({why})"))
            continue
        z = p.zero_config
        seen = (int(z.stage), _device(z.offload_optimizer), _device(z.offload_param))
        cases.append(
            (
                seen == (3, "cpu", "cpu"),
                f"world_size={n}: stage, optimizer, params on {seen}, want (3, cpu, cpu)",
            )
        )
    return tally(cases)


def _batch_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (n, micro, _), p, why in _parsed(got, seed):
        if p is None:
            cases.append((False, f"world_size={n}: not parsed ({why})"))
            continue
        seen = (p.train_batch_size, p.train_micro_batch_size_per_gpu, p.gradient_accumulation_steps)
        want = (micro * n, micro, 1)
        cases.append((seen == want, f"world_size={n}: (train, micro, accumulation) = {seen}, want {want}"))
    return tally(cases)


def _zeropp_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (n, micro, gpn), p, why in _parsed(got, seed):
        if p is None:
            cases.append((False, f"world_size={n}: DeepSpeed says {why}"))
            continue
        z = p.zero_config
        seen = (
            int(z.stage),
            bool(z.zero_quantized_weights),
            int(z.zero_hpz_partition_size),
            bool(z.zero_quantized_gradients),
            p.train_batch_size,
        )
        want = (3, True, gpn, True, micro * n)
        cases.append(
            (
                seen == want,
                f"world_size={n}, {gpn} GPUs per node: (stage, qwZ, hpZ, qgZ, train batch) = {seen}, want {want}",
            )
        )
    return tally(cases)


EXERCISE = Exercise(
    "ex05_deepspeed",
    "DeepSpeed configs for offload and ZeRO++",
    (
        Check(
            "offload: DeepSpeed's parser accepts it on n ranks",
            2,
            _offload_probe,
            _accepted_judge,
            answers=OFFLOAD,
        ),
        Check(
            "offload: ZeRO-3 with optimizer state and parameters on the CPU",
            2,
            _offload_probe,
            _offload_judge,
            answers=OFFLOAD,
        ),
        Check(
            "offload: train batch = micro batch x n, no accumulation",
            1,
            _offload_probe,
            _batch_judge,
            answers=OFFLOAD,
        ),
        Check(
            "ZeRO++: accepted, with qwZ, hpZ over one node and qgZ",
            3,
            _zeropp_probe,
            _zeropp_judge,
            answers=("zeropp_config",),
        ),
    ),
)
