"""Notebook 04's build check: your 02 engine with your offloaded optimizer step, on real ranks, judged step by step.

`check_offload(make_optimizer)` trains your 02 pieces with this `make_optimizer` in place of 02's and says one
sentence per property that fails: "placement:" AdamW updates host copies of the shards, each in a buffer of its
own, and keeps its m and v beside them; "memory:" the device keeps 0 B of optimizer state and the host AdamW's m
and v and the gradient's copy, as `labkit.budget`'s offload plan puts them; "gradient:" at each step the host
copy's gradient is the device shard's, unscaled; "weights:" after each step the device shard is what AdamW made
of its host copy; "bytes:" each step copies the gradient shards down and the weight shards up and nothing more,
the plan's `host_io_bytes_per_rank` to the byte; "losses:" they are `single`'s (float32, LOSS_RTOL).
On CPU ranks host and device are one memory, so the check reads the property itself: a tensor is on the device
when it is a shard, a shard's gradient or a parameter (same storage), or on an accelerator; a transfer is a copy
(copy_, to(copy=True), clone) between such a tensor and another, counted as the optimizer step runs it.
The 02 pieces, stubs, single's losses and the training steps are 03's check's (`prefetch_check`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import budget
from labkit.buildalong.checks import _learner, _LearnerError
from labkit.buildalong.prefetch_check import single_losses, stub_sentence, train_steps, worst_rel, your_02
from labkit.buildalong.scaffold import Learner, Pieces
from labkit.buildalong.verdicts import LOSS_RTOL, CheckResult, error_sentence, launched
from labkit.engines import on_rank
from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.names import HOST, ZERO3

STEP = "offload"
TIMEOUT_S = 120.0
MOMENTS = ("adam_m", "adam_v")  # labkit.budget's names of AdamW's two moments
_MOVES = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
}


def check_offload(
    make_optimizer: Callable,
    world_size: int = 2,
    model: str = "tiny",
    steps: int = 3,
    yours: Pieces | None = None,
    quiet: bool = False,
) -> CheckResult:
    """Your 02 engine (`yours`, default: notebook 02's build cells) with this `make_optimizer`, `steps` steps on
    `world_size` ranks: the result, printed unless `quiet`. Its figures hold the losses, each step's bytes
    down and up, the optimizer's bytes on device and host, and the plan's."""
    (result,) = check_offloads([make_optimizer], world_size, model, steps, yours)
    if not quiet:
        print(result)
    return result


def check_offloads(
    candidates: Sequence[Callable],
    world_size: int = 2,
    model: str = "tiny",
    steps: int = 3,
    yours: Pieces | None = None,
) -> list[CheckResult]:
    """`check_offload`'s result for each make_optimizer of `candidates`, all trained in ONE launch (a launch
    each would pay a start-up each); single's losses are computed once for all."""
    stubs = [stub_sentence(c) for c in candidates]
    plain, waiting = your_02(yours, "this make_optimizer in place of 02's")
    if plain is None:
        return [CheckResult(STEP, False, stub or waiting) for stub in stubs]
    written = [
        dataclasses.replace(plain, make_optimizer=c)
        for c, stub in zip(candidates, stubs, strict=True)
        if not stub
    ]
    if not written:
        return [CheckResult(STEP, False, stub) for stub in stubs]
    ranks, sentence = launched(
        _rank_offload,
        world_size,
        written,
        model,
        steps,
        timeout_s=TIMEOUT_S * len(written),
        question="does every rank step its optimizer, and call no collective in it?",
    )
    if ranks is None:
        return [CheckResult(STEP, False, stub or sentence) for stub in stubs]
    records = iter(zip(*ranks, strict=True))  # per candidate: every rank's record of it
    return [
        CheckResult(STEP, False, stub) if stub else _result(list(next(records)), model, world_size)
        for stub in stubs
    ]


def _result(ranks: list[dict], model: str, n: int) -> CheckResult:
    """One candidate's result from every rank's record of it (rank order)."""
    failed = next(((rank, r) for rank, r in enumerate(ranks) if "error" in r), None)
    if failed is not None:
        return CheckResult(STEP, False, error_sentence(*failed), failed[1])
    return verdict(ranks[0], model, n)


def formula(model: str, n: int) -> dict[str, int]:
    """`labkit.budget`'s plan for ZeRO-3 with the optimizer offloaded to the host, on the engine's shards (fp32,
    each parameter padded on dim 0), per rank: "down" (the gradient shards) and "up" (the weight shards), bytes
    per step; "device_optimizer" (0), "host_moments" (m and v) and "host_grads" (the gradient's copy), bytes."""
    padded = sum(budget.padded_numel(tuple(p.shape), n) for p in build_model(model).parameters())
    plan = budget.plan(padded, n, ZERO3, precision="fp32", offload_optimizer=HOST)
    host, gpu = plan["host_bytes_per_rank"], plan["memory_bytes_per_rank"]
    return {
        "down": host["grads"],  # the gradient shard goes down in the precision the host keeps it in
        "up": plan["host_io_bytes_per_rank"] - host["grads"],
        "host_io": plan["host_io_bytes_per_rank"],
        "device_optimizer": sum(gpu[t] for t in ("master", *MOMENTS)),
        "host_moments": sum(host[t] for t in MOMENTS),
        "host_grads": host["grads"],
    }


# ------------------------------------------------------------------------------------------------ ranks


class _Copies(TorchDispatchMode):
    """While on: the bytes of each copy from a device tensor to a host one (`down`) and back (`up`)."""

    def __init__(self, on_device: Callable[[torch.Tensor], bool]):
        super().__init__()
        self.on_device = on_device
        self.down = self.up = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _MOVES:
            src, dst = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            nbytes = dst.numel() * dst.element_size()
            if self.on_device(src) and not self.on_device(dst):
                self.down += nbytes
            elif self.on_device(dst) and not self.on_device(src):
                self.up += nbytes
        return out


class _Watch:
    """The engine's optimizer step, watched: per step the bytes copied down and up, whether each host copy's
    gradient was its shard's and each shard came back as AdamW left its host copy."""

    def __init__(self, eng):
        self.eng = eng
        self.steps: list[dict] = []
        self.device: set[int] = set()  # the device's storages as the last step began
        self.step = eng.optimizer_step
        eng.optimizer_step = self.watched  # what on_rank.timed_step calls

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or _storage(t) in self.device

    def watched(self) -> None:
        shards = self.eng.shards
        full = [p for unit in self.eng.units for p in unit.params]
        self.device = {_storage(t) for t in [*shards, *full, *(s.grad for s in shards if s.grad is not None)]}
        self.device.discard(0)  # a freed parameter's empty storage
        with _Copies(self.on_device) as copies:
            self.step()
        host = _host_params(self.eng.optimizer)
        paired = host is not None and len(host) == len(shards)
        pairs = list(zip(shards, host, strict=True)) if paired else []
        grads = [(s.grad, h.grad) for s, h in pairs]
        self.steps.append(
            {
                "down": copies.down,
                "up": copies.up,
                "grads_differ": sum(not _same(h, d) for d, h in grads),
                "grad_scale": next((_scale(h, d) for d, h in grads if not _same(h, d)), None),
                "weights_differ": sum(not torch.equal(s, h.to(s.device)) for s, h in pairs),
            }
        )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _same(host_grad: torch.Tensor | None, grad: torch.Tensor | None) -> bool:
    return host_grad is not None and grad is not None and torch.equal(host_grad.to(grad.device), grad)


def _scale(host_grad: torch.Tensor | None, grad: torch.Tensor | None) -> float | None:
    """How many times the device gradient the host's is (least squares); None when the host has none."""
    if host_grad is None or grad is None or host_grad.shape != grad.shape:
        return None
    h, d = host_grad.detach().double().reshape(-1).cpu(), grad.detach().double().reshape(-1).cpu()
    return float(h @ d / (d @ d)) if float(d @ d) else None


def _host_params(optimizer) -> list[torch.Tensor] | None:
    """The tensors a torch optimizer updates, in order; None for anything else."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    return [p for group in optimizer.param_groups for p in group["params"]]


def _placement(eng, watch: _Watch) -> dict:
    """Where the optimizer's tensors live after the last step: bytes of its moments on each side, and which of
    the tensors it updates (and their gradients) are the device's."""
    host = _host_params(eng.optimizer)
    if host is None:
        return {"optimizer": type(eng.optimizer).__name__}
    moments = [(p, t) for p in host for t in eng.optimizer.state.get(p, {}).values() if _is_moment(t)]
    return {
        "optimizer": None,
        "copies": len(host),
        "shards": len(eng.shards),
        "shapes_differ": sum(
            tuple(p.shape) != tuple(s.shape) for p, s in zip(host, eng.shards, strict=False)
        ),
        "on_device": sum(watch.on_device(p) for p in host),
        "grads_on_device": sum(p.grad is not None and watch.on_device(p.grad) for p in host),
        "device_optimizer": sum(_nbytes(t) for p, t in moments if watch.on_device(p) or watch.on_device(t)),
        "host_moments": sum(_nbytes(t) for p, t in moments if not (watch.on_device(p) or watch.on_device(t))),
        "host_grads": sum(
            _nbytes(p.grad) for p in host if p.grad is not None and not watch.on_device(p.grad)
        ),
    }


def _is_moment(t) -> bool:
    """A state tensor of the parameter's shape (m, v), not AdamW's 0-dim step counter (kept on the CPU by torch)."""
    return torch.is_tensor(t) and t.dim() > 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rank_offload(written: list[Pieces], model: str, steps: int) -> list[dict]:
    """Rank side: for each of `written`, `steps` steps with the optimizer step watched; their losses and
    single's (computed once), or where the learner's code raised."""
    torch.set_num_threads(1)  # as the loop: one core per rank, and no OpenMP pool in a forked rank
    info = on_rank.rank_info()
    cfg = RunConfig(model=model, world_size=info.world_size, steps=steps)
    oracle = single_losses(cfg, info.device)
    out = []
    for pieces in written:
        try:
            eng = _learner("attach and make_optimizer", Learner(pieces).build, cfg, build_model(model), info)
            watch = _Watch(eng)
            losses = train_steps(eng, model, steps)
        except _LearnerError as e:
            out.append({"error": e.text, "where": e.where, "line": e.line})
            continue
        out.append(
            {"losses": losses, "oracle": oracle, "steps": watch.steps, "placement": _placement(eng, watch)}
        )
    return out


# ------------------------------------------------------------------------------------------------ verdict


def verdict(r: dict, model: str, n: int) -> CheckResult:
    """The result, from rank 0's record: one sentence per failing property, else what held."""
    want = formula(model, n)
    place = r["placement"]
    figures = {
        "losses": r["losses"],
        "oracle": r["oracle"],
        "loss_rel": worst_rel(r["losses"], r["oracle"]),
        "down": [s["down"] for s in r["steps"]],
        "up": [s["up"] for s in r["steps"]],
        **{k: place.get(k) for k in ("device_optimizer", "host_moments", "host_grads")},
        "formula": want,
    }
    if place["optimizer"] is not None:
        return CheckResult(
            STEP,
            False,
            f"placement: make_optimizer returned a {place['optimizer']}, not the torch.optim.AdamW over your host "
            "copies (with grads_down and weights_up registered as its step hooks)",
            figures,
        )
    said = [
        _placement_said(place),
        _memory_said(place, want),
        _gradient_said(r["steps"]),
        _weights_said(r["steps"]),
        _bytes_said(r["steps"], want),
        _losses_said(r, figures["loss_rel"]),
    ]
    failing = [s for s in said if s]
    if failing:
        return CheckResult(STEP, False, "\n  ".join(failing), figures)
    return CheckResult(
        STEP,
        True,
        f"AdamW's weights, m and v on the host, each in a buffer of its own: the device keeps 0 B of optimizer "
        f"state, the host m and v ({want['host_moments']:,} B) and the gradient's copy ({want['host_grads']:,} B), "
        f"as the budget's offload plan puts them; every step copied the gradient shards down ({want['down']:,} B) "
        f"and the updated weight shards up ({want['up']:,} B), the plan's {want['host_io']:,} B per rank to the "
        f"byte; losses equal to single's over {len(r['losses'])} steps (largest relative difference "
        f"{figures['loss_rel']:.1e})",
        figures,
    )


def _placement_said(place: dict) -> str | None:
    if place["copies"] != place["shards"] or place["shapes_differ"]:
        return (
            f"placement: AdamW updates {place['copies']} tensors, {place['shapes_differ']} of another shape than "
            f"their shard, for {place['shards']} shards: give it one host copy per shard, in the shards' order"
        )
    if place["on_device"]:
        return (
            f"placement: AdamW updates {place['on_device']} of the device's own tensors (a shard, or one sharing its "
            "storage: on CPU ranks .to('cpu') hands back the same tensor), so its m and v were made beside them on "
            "the device: give it host copies, each in a buffer of its own (torch.empty(..., device='cpu'), then copy_)"
        )
    if place["grads_on_device"]:
        return (
            f"placement: {place['grads_on_device']} host copies take as .grad the device's own gradient (the same "
            "storage), which AdamW then reads across the link: grads_down must copy each gradient shard into host "
            "memory"
        )
    return None


def _memory_said(place: dict, want: dict[str, int]) -> str | None:
    got = {k: place[k] for k in ("device_optimizer", "host_moments", "host_grads")}
    wanted = {k: want[k] for k in got}
    if got == wanted:
        return None
    return (
        f"memory: the device keeps {got['device_optimizer']:,} B of optimizer state (the plan: "
        f"{wanted['device_optimizer']:,} B), the host m and v {got['host_moments']:,} B ({wanted['host_moments']:,} "
        f"B) and the gradient's copy {got['host_grads']:,} B ({wanted['host_grads']:,} B): AdamW's state is made "
        "beside the tensors it updates, and each host copy keeps one float32 gradient of its shard's shape"
    )


def _gradient_said(steps: list[dict]) -> str | None:
    s = next((i for i, step in enumerate(steps) if step["grads_differ"]), None)
    if s is None:
        return None
    scale = steps[s]["grad_scale"]
    was = f"{scale:.4g} times the device's" if scale is not None else "missing, or of another shape"
    return (
        f"gradient: at step {s}'s AdamW {steps[s]['grads_differ']} host copies' gradients differ from their "
        f"shards' (the first: {was}): grads_down copies each shard's gradient as after_grad left it (already the "
        "mean over ranks), before AdamW's step (a step pre-hook), not rescaled"
    )


def _weights_said(steps: list[dict]) -> str | None:
    s = next((i for i, step in enumerate(steps) if step["weights_differ"]), None)
    if s is None:
        return None
    return (
        f"weights: after step {s}'s AdamW, {steps[s]['weights_differ']} device shards differ from their host "
        "copies: the units gather from the device shards, so weights_up copies each updated host copy back into "
        "its shard after AdamW's step (a step post-hook)"
    )


def _bytes_said(steps: list[dict], want: dict[str, int]) -> str | None:
    for s, step in enumerate(steps):
        if (step["down"], step["up"]) != (want["down"], want["up"]):
            return (
                f"bytes: step {s} copied {step['down']:,} B from device to host and {step['up']:,} B back, the "
                f"plan {want['down']:,} B down (the gradient shards) and {want['up']:,} B up (the updated weight "
                "shards): each crosses once per step, by a copy (copy_ into a host buffer, or .to(..., copy=True))"
            )
    return None


def _losses_said(r: dict, worst: float) -> str | None:
    if worst <= LOSS_RTOL:
        return None
    diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], r["oracle"], strict=True)]
    k = next(i for i, d in enumerate(diffs) if d > LOSS_RTOL)
    return (
        f"losses: at step {k} your engine's loss is {r['losses'][k]:.6f}, single's {r['oracle'][k]:.6f} (relative "
        f"{diffs[k]:.1e}, float32 allows {LOSS_RTOL:.0e}): AdamW on the host is 02's (lab's lr, betas, eps and "
        "weight_decay) over exact copies of the shards; if the other properties hold, run 02's checks again"
    )
