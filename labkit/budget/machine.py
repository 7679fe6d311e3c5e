"""A calibrated machine: the profile `labkit calibrate` writes (compute rate, core share, collective fits),
checked and read, so a plan prices a step with measured costs instead of peak x MFU and datasheet links.
"""

from __future__ import annotations

MACHINE_KEYS = ("compute_flops_per_s", "core_share", "collectives")
COLLECTIVE_FIT_KEYS = ("latency_s", "gbytes")


def check_machine_profile(profile: dict) -> dict:
    """`profile` (what `labkit calibrate` writes) if it has what a plan prices a step with, else ValueError.

    Keys: compute_flops_per_s (one rank alone, FLOP/s at 6 x params x tokens), core_share {"n": share of
    that rate each of n ranks keeps}, collectives {kind: {"n": {latency_s, gbytes, ...}}}; others are kept.
    """
    if not isinstance(profile, dict) or any(k not in profile for k in MACHINE_KEYS):
        raise ValueError(
            f"a machine profile needs the keys {', '.join(MACHINE_KEYS)}; write one with labkit calibrate."
        )
    shares, fits = profile["core_share"], profile["collectives"]
    shaped = isinstance(shares, dict) and isinstance(fits, dict)
    shaped = shaped and all(
        isinstance(by_n, dict)
        and all(isinstance(fit, dict) and all(k in fit for k in COLLECTIVE_FIT_KEYS) for fit in by_n.values())
        for by_n in fits.values()
    )
    if not shaped:
        raise ValueError(
            "a machine profile's core_share maps world sizes to shares, and its collectives map each kind and "
            f"world size to {{{', '.join(COLLECTIVE_FIT_KEYS)}}}; write it again with labkit calibrate."
        )
    values = [profile["compute_flops_per_s"], *shares.values()]
    values += [fit[k] for by_n in fits.values() for fit in by_n.values() for k in ("gbytes",)]
    if not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise ValueError(
            "a machine profile's rates, shares and bandwidths must be positive numbers; "
            "write it again with labkit calibrate."
        )
    return profile


def load_machine_profile(path: str) -> dict:
    """The machine profile in the JSON file `path` (checked); ValueError in one sentence when it is not one."""
    import json

    try:
        with open(path) as f:
            return check_machine_profile(json.load(f))
    except OSError as e:
        raise ValueError(
            f"cannot read the machine profile {path!r} ({e.strerror}); pass the file labkit calibrate wrote."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path!r} is not JSON; pass the file labkit calibrate --out wrote.") from None


def _measured_at(profile_part: dict, world_size: int, what: str) -> dict | float:
    if str(world_size) not in profile_part:
        have = ", ".join(sorted(profile_part, key=int))
        raise ValueError(
            f"the machine profile has no {what} at world_size={world_size} (it has {have}); "
            f"calibrate there: labkit calibrate --world-sizes {world_size}."
        )
    return profile_part[str(world_size)]


def machine_flops_per_s(machine: dict, world_size: int) -> float:
    """FLOP/s one of `world_size` ranks computes at on the profiled machine: the one-rank rate x its core share."""
    return machine["compute_flops_per_s"] * _measured_at(machine["core_share"], world_size, "core share")


def machine_collective_s(machine: dict, kind: str, world_size: int, wire_bytes: int, calls: int) -> float:
    """The backend's own seconds for `calls` collectives of `kind` sending `wire_bytes` in all (one rank):
    calls x latency_s + wire_bytes / (gbytes x 1e9), the profile's fit at that world size."""
    if kind not in machine["collectives"]:
        raise ValueError(
            f"the machine profile has no fit for {kind}; it has {', '.join(machine['collectives'])}."
        )
    fit = _measured_at(machine["collectives"][kind], world_size, f"{kind} fit")
    return calls * fit["latency_s"] + wire_bytes / (fit["gbytes"] * 1e9)


def machine_sync_s(machine: dict, world_size: int) -> float:
    """Seconds one wait on every rank costs mid-step beyond the collective itself (the ranks' drift), at
    `world_size`: the profile's `sync_s`; 0 for a profile written before calibrate measured it."""
    return float(machine.get("sync_s", {}).get(str(world_size), 0.0))


def machine_summary(machine: dict, world_size: int) -> dict:
    """What a plan's result says of the profile it used: the rates at this world size and where it was measured."""
    share = _measured_at(machine["core_share"], world_size, "core share")
    return {
        "compute_flops_per_s": machine["compute_flops_per_s"],
        "core_share": share,
        "flops_per_s_per_rank": machine["compute_flops_per_s"] * share,
        "sync_s": machine_sync_s(machine, world_size),
        "calibrated_on": machine.get("machine", {}),
    }
