"""The debugging clinic (notebook 09): runs that go wrong the way users report them, and the tools that say why.

Each case is a `Case`: the question the learner answers before the evidence, four causes to choose from, and
the usual wrong reasoning. The broken run and its fix are measured live on CPU ranks: a hang read by torch's
flight recorder (`hang`, through `labkit.flight`), DeepSpeed's ZeRO-3 buffers beside FSDP2 (`deepspeed_buffers`,
the lab's memory probe and the engine's accounting), forward prefetch in a `torch.profiler` trace
(`prefetch_trace`, through `labkit.traces`), and the FSDP2 cases of `clinic_ranks` (`fsdp2_cases`).
`cause(name, facts)` is the cause the measured facts show, or a sentence saying the run did not show it.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import labkit
from labkit import flight, tables, traces
from labkit.engines import deepspeed as deepspeed_engine
from labkit.engines import loop
from labkit.engines.base import RunConfig
from labkit.engines.ds_config import block_numel
from labkit.engines.on_rank import rank_batch, rank_info, timed_step
from labkit.engines.registry import DEEPSPEED, FSDP2
from labkit.lessons import clinic_ranks
from labkit.lessons.fsdp2_features import build_engine
from labkit.lessons.production import global_mean
from labkit.model import build_model


@dataclass(frozen=True)
class Case:
    """One case: the learner's question, four causes (the answer is `answer`, from 1) and the usual mistake."""

    question: str
    choices: tuple[str, str, str, str]
    answer: int
    mistake: str


CASES = {
    "hang": Case(
        "Why did both ranks stop at the first step with no error?",
        (
            "rank 0 ran out of memory and its peer waits for it",
            "one rank issued a collective the other never issued, so each waits in a different one",
            "gloo's link is too slow for the model's all-gathers",
            "the optimizer step deadlocks on the sharded parameters",
        ),
        2,
        "blaming speed or memory: a slow link or an out-of-memory error ends in a time or an error, "
        "a hang is two ranks waiting in collectives that do not match.",
    ),
    "accumulation": Case(
        "Why does accumulating over micro-batches send as much as one step per micro-batch?",
        (
            "FSDP2 must reduce-scatter after every backward, whatever the loop does",
            "the micro-batches are too small for FSDP2 to skip the sync",
            "the loop's no_sync guard finds no no_sync on an FSDP2 model and does nothing",
            "AdamW steps after every micro-batch",
        ),
        3,
        "taking DDP's API for FSDP2's: FSDP2 skips the reduce-scatter only when told with "
        "set_requires_gradient_sync(False).",
    ),
    "state_dict": Case(
        "Why does saving a checkpoint exceed the memory that training fits in?",
        (
            "the optimizer state is written twice",
            "every rank all-gathers and keeps the whole model to build a full state dict",
            "the checkpoint is written in fp64",
            "the sharded state dict copies each shard",
        ),
        2,
        "thinking a state dict is free because the shards are: a full one is the unsharded model, on "
        "every rank unless it is kept on rank 0 only.",
    ),
    "tied": Case(
        "Why does the first forward of GPT-2 fail after the head got a unit of its own?",
        (
            "GPT-2's head is too large to shard",
            "the head's weight is the embedding's, and a parameter can belong to one unit only",
            "the blocks must be sharded before the head",
            "FSDP2 cannot shard a Hugging Face model",
        ),
        2,
        "wrapping by module without looking at parameters: a tied weight is one tensor, so its two "
        "modules must share one unit.",
    ),
    "bf16": Case(
        "Why does a fine-tuning run in bf16 barely move under FSDP2 where DeepSpeed's trains?",
        (
            "FSDP2 averages gradients where DeepSpeed sums them",
            "the weights are bf16, so AdamW's small updates round away; DeepSpeed updates fp32 masters",
            "bf16 gradients overflow",
            "FSDP2 skips the optimizer step for bf16 parameters",
        ),
        2,
        "looking at the gradients: they are fine; the update is smaller than half a bf16 step of the "
        "weight it is added to.",
    ),
    "buffers": Case(
        "Why does DeepSpeed's ZeRO-3 hold far more per rank than FSDP2 on this small model?",
        (
            "ZeRO-3 keeps the full model gathered on every rank",
            "the optimizer state is not sharded at its defaults",
            "a flat gradient bucket sized for billion-parameter models, allocated whatever the model",
            "gloo's buffers count against DeepSpeed",
        ),
        3,
        "turning the parameter knobs (stage3_max_live_parameters, stage3_param_persistence_threshold): "
        "they bound gathered weights, which are small here; the bucket is a gradient buffer.",
    ),
    "prefetch": Case(
        "Why does the trace show no block's forward all-gather begin before the previous block's forward ends?",
        (
            "gloo cannot run a collective beside compute",
            "unless told, FSDP2 issues a block's forward all-gather in that block's own pre-forward",
            "reshard_after_forward=True forbids prefetching",
            "the all-gathers are too small to be worth prefetching",
        ),
        2,
        "taking implicit prefetch for a promise: it is the backward's; in forward a gather overlaps only if the "
        "CPU runs ahead of the GPU, so a CPU-bound step needs set_modules_to_forward_prefetch.",
    ),
}


# ----------------------------------------------------------------------------------------------- the hang


def log_loss(cfg: RunConfig, every_rank: bool) -> list[float]:
    """Rank side: FSDP2 training that logs the global mean loss after each step. With `every_rank` False,
    only rank 0 computes it (an all-reduce its peer never joins), the bug; True, every rank does."""
    engine = build_engine(cfg)
    info = rank_info()
    logged = []
    for step in range(cfg.steps):
        tokens, targets = rank_batch(step, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
        loss, _ = timed_step(engine, step, (tokens, targets))
        if every_rank or info.rank == 0:
            logged.append(global_mean([loss.item()]))
    return logged


def hang(
    cfg: RunConfig, timeout_s: float, dump_after_s: float, dump_dir: str | None = None
) -> dict[str, Any]:
    """`log_loss` broken then fixed, each under torch's flight recorder (`flight.record`) with `timeout_s`.

    Per way: `seconds` (the launch's wall time, until the timeout stopped it or it finished), `finished`,
    `stopped` (the launch's error type, or None), `mismatch` (the lab's one line on the first collective
    the ranks disagree on), `torch` (what torch's analyser said), `ops` ({rank: its collectives, in order}).
    The dumps go to `dump_dir/broken` and `dump_dir/fixed`, or to a temporary folder removed after.
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="labkit-flight-") as scratch:
        root = Path(dump_dir or scratch)
        for way, every_rank in (("broken", False), ("fixed", True)):
            start_s = time.perf_counter()
            run = flight.record(
                log_loss,
                cfg.world_size,
                cfg,
                every_rank,
                dump_dir=root / way,
                dump_after_s=dump_after_s,
                timeout=timeout_s,
            )
            out[way] = {
                "seconds": time.perf_counter() - start_s,
                "finished": run.results is not None,
                "stopped": type(run.error).__name__ if run.error else None,
                "mismatch": run.analysis["mismatch"],
                "torch": run.analysis["torch"],
                "ops": {r: [e.op for e in es] for r, es in run.analysis["entries"].items()},
            }
    return out


ANALYSER_KEYS = ("has errors", "collective:", "input sizes", "error msg")  # the lines of its report shown


def analyser_lines(said: str, frames: int = 2) -> list[str]:
    """torch's flight-recorder report, short: its lines that name the collective and the error (`ANALYSER_KEYS`),
    then the first `frames` frames of the collective's stack in the lab's lessons (where the course's code
    issued it), as paths inside labkit."""
    head, _, stack = said.partition("collective stack trace:")
    lines = [line.strip() for line in head.splitlines() if any(k in line for k in ANALYSER_KEYS)]
    ours = []
    for line in stack.splitlines():
        function, _, path = line.strip().partition(" at ")
        if "/labkit/lessons/" in path:
            ours.append(f"{function} at labkit/{path.split('/labkit/')[-1]}")
    return lines + (["issued at: " + "; ".join(ours[:frames])] if ours else [])


# --------------------------------------------------------------------------------------- DeepSpeed's buffers

DEEPSPEED_WAYS = ("defaults", "parameter knobs", "reduce bucket")


def deepspeed_options(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """DeepSpeed's ZeRO-3 three ways (`DEEPSPEED_WAYS`): its defaults; the two parameter knobs users turn first
    (every parameter sharded, one element live); the fix, a reduce bucket of one block's elements
    (`ds_config.block_numel`)."""
    defaults, knobs, bucket = DEEPSPEED_WAYS
    return {
        defaults: {"ds_mode": "defaults"},
        knobs: {
            "ds_mode": "defaults",
            "zero_overrides": {"stage3_max_live_parameters": 1, "stage3_param_persistence_threshold": 0},
        },
        bucket: {"ds_mode": "defaults", "zero_overrides": {"reduce_bucket_size": block_numel(cfg.model)}},
    }


def deepspeed_buffers(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's three ways (`deepspeed_options`) and FSDP2, one step each, in one launch (`loop.run_many`).

    Per way: `peak_bytes` (the largest rank's peak of live tensor bytes over a step, the lab's probe),
    `state_bytes` (rank 0's, by category), `bucket_bytes` (the engine's accounting of its reduce bucket,
    `deepspeed.state_bytes_accounting`) and `losses`; FSDP2's run has all but the bucket.
    """
    options = deepspeed_options(cfg)
    one = replace(cfg, steps=1)  # the peak is measured in a step of its own after these
    runs = [(DEEPSPEED, replace(one, options=o)) for o in options.values()] + [(FSDP2, one)]
    records = loop.run_many(runs)
    model = build_model(cfg.model, cfg.seed)
    out = {}
    for (engine, run), name, record in zip(runs, [*options, FSDP2], records, strict=True):
        out[name] = {
            "peak_bytes": max(record["peak_mem_bytes"]),
            "state_bytes": record["state_bytes"],
            "losses": record["losses"],
        }
        if engine == DEEPSPEED:
            terms = deepspeed_engine.state_bytes_accounting(model, run, cfg.world_size)
            out[name]["bucket_bytes"] = terms.get("reduce bucket (flat)", 0)
    return out


# ---------------------------------------------------------------------------------- forward prefetch, traced


def prefetch_trace(cfg: RunConfig, out_dir: str | None = None) -> dict[str, Any]:
    """FSDP2 without and with explicit forward prefetch (`cfg.prefetch`), each traced by `torch.profiler` on
    every rank (`labkit.traces.trace`: one step, a Chrome trace per rank), rank 0's read by `early_gathers`.

    The traces go to `out_dir/broken` and `out_dir/fixed` (open them in Perfetto), or to a temporary folder
    removed after. The figure is the order of the trace's events, not their durations.
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="labkit-trace-") as scratch:
        root = Path(out_dir or scratch)
        for way, prefetch in (("broken", False), ("fixed", True)):
            paths = traces.trace(FSDP2, replace(cfg, prefetch=prefetch), root / way)
            events = json.loads(paths[0].read_text())["traceEvents"]
            out[way] = early_gathers(events, len(build_model(cfg.model).blocks))
    return out


def early_gathers(events: list[dict], blocks: int) -> dict[str, int]:
    """In one rank's Chrome trace of an FSDP2 step: `early`, how many blocks i >= 1 had their forward
    all-gather begin inside block i-1's forward (after its pre-forward began, before its post-forward), of
    `blocks` - 1; `prefetches`, the step's "FSDP::forward_prefetch" annotations."""
    starts: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name", "").startswith("FSDP::"):
            starts[e["name"]] = min(e["ts"], starts.get(e["name"], e["ts"]))
    early = 0
    for i in range(1, blocks):
        gather = starts[f"FSDP::all_gather (blocks.{i})"]  # the step's first: its forward's
        early += (
            starts[f"FSDP::pre_forward (blocks.{i - 1})"]
            <= gather
            < starts[f"FSDP::post_forward (blocks.{i - 1})"]
        )
    prefetches = sum(name.startswith("FSDP::forward_prefetch") for name in starts)
    return {"early": early, "of": blocks - 1, "prefetches": prefetches}


def prefetch_table(facts: dict[str, Any]) -> str:
    """Forward all-gathers that began inside the previous block's forward, and forward-prefetch annotations,
    in rank 0's trace without and with explicit prefetch."""
    rows = [("FSDP2", "forward all-gathers begun inside the previous block", "forward_prefetch events")]
    for way, label in (("broken", "implicit prefetch only"), ("fixed", "set_modules_to_forward_prefetch")):
        got = facts[way]
        rows.append((label, f"{got['early']} of {got['of']}", str(got["prefetches"])))
    return tables.fixed_width(rows, rule=True)


# ----------------------------------------------------------------------------------------- the FSDP2 cases


def fsdp2_cases(cfg: RunConfig, micro_steps: int, fine_tune_lr: float) -> dict[str, Any]:
    """Rank 0's facts of every FSDP2 case (`clinic_ranks.fsdp2_cases`) and rank 1's state-dict peaks
    (the rank that should hold nothing of a checkpoint kept on rank 0), from one launch."""
    ranks = labkit.launch(clinic_ranks.fsdp2_cases, cfg.world_size, cfg, micro_steps, fine_tune_lr)
    facts = ranks[0]
    facts["state_dict"]["other_rank_peak_bytes"] = ranks[-1]["state_dict"]["peak_bytes"]
    return facts


# ------------------------------------------------------------------------------------------------ causes


def cause(name: str, facts: dict[str, Any]) -> int:
    """The number of case `name`'s cause, once the run's `facts` show it; a RuntimeError in a sentence if not."""
    broken, fixed = facts.get("broken"), facts.get("fixed")
    shown = {
        "hang": lambda: not broken["finished"] and broken["mismatch"] and fixed["finished"],
        "accumulation": lambda: broken["reduce_scatters"][0] > fixed["reduce_scatters"][0],
        "state_dict": lambda: facts["other_rank_peak_bytes"]["full_everywhere"] >= facts["full_model_bytes"],
        "tied": lambda: broken["error"] and not broken["tied"] and fixed["tied"],
        "bf16": lambda: broken["unchanged"] > fixed["unchanged"],
        "prefetch": lambda: broken["early"] < fixed["early"],
        "buffers": lambda: facts["defaults"]["bucket_bytes"] > facts["reduce bucket"]["bucket_bytes"],
    }[name]()
    if not shown:
        hint = " (a machine this busy may need a longer hang_timeout_s)" if name == "hang" else ""
        raise RuntimeError(f"this run did not show case {name!r}'s cause{hint}; its facts: {facts}")
    return CASES[name].answer


# ------------------------------------------------------------------------------------- what the notebook shows


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    """max |a_i - b_i| / |b_i| over two equally long loss curves."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def hang_lines(facts: dict[str, Any], last: int = 3) -> list[str]:
    """The hang's evidence: how the broken run ended, each rank's last collectives, the lab's reading of the
    dumps and torch's analyser's; then how the fixed run ended."""
    broken, fixed = facts["broken"], facts["fixed"]
    out = [
        f"broken: stopped by the launch's timeout ({broken['stopped']}) after {broken['seconds']:.1f} s; "
        f"ranks that finished: {0 if not broken['finished'] else len(broken['ops'])} of {len(broken['ops'])}",
        *(
            f"  rank {r}'s last {last} collectives: {', '.join(ops[-last:])}"
            for r, ops in broken["ops"].items()
        ),
        f"  labkit.flight: {broken['mismatch']}",
        *(f"  torch's analyser: {line}" for line in analyser_lines(broken["torch"])),
        f"fixed: finished in {fixed['seconds']:.1f} s; every rank issued "
        f"{len(fixed['ops'][min(fixed['ops'])])} collectives; first mismatch: {fixed['mismatch'] or 'none'}",
    ]
    return out


def accumulation_table(facts: dict[str, Any]) -> str:
    """Reduce-scatters per optimizer step (the lab's probe, torch's CommDebugMode), unsharded gradient bytes
    held after the first micro-step, for the DDP-style loop and FSDP2's; and whether their losses agree."""
    rows = [("loop", "reduce-scatters / step", "CommDebugMode", "gradients held after micro-step 1")]
    for way, label in (("broken", "no_sync guard (broken)"), ("fixed", "set_requires_gradient_sync")):
        got = facts[way]
        rows.append(
            (
                label,
                ", ".join(str(n) for n in got["reduce_scatters"]),
                str(got["comm_debug"].get("_reduce_scatter_base_", 0)),
                f"{got['held_grad_bytes'][0]:,} B",
            )
        )
    diff = largest_relative_difference(facts["broken"]["losses"], facts["fixed"]["losses"])
    return f"{tables.fixed_width(rows, rule=True)}\nlosses, broken against fixed: largest relative difference {diff:.1e}"


def state_dict_table(facts: dict[str, Any]) -> str:
    """Peak live bytes on rank 0 and on the last rank while taking the state dict, each way."""
    rows = [("state dict", "rank 0 peak", "other rank's peak")]
    for way, label in (
        ("full_everywhere", "full_state_dict=True (broken)"),
        ("full_on_rank0", "full, cpu_offload=True"),
        ("sharded", "sharded (DCP)"),
    ):
        rows.append((label, f"{facts['peak_bytes'][way]:,} B", f"{facts['other_rank_peak_bytes'][way]:,} B"))
    return (
        f"{tables.fixed_width(rows, rule=True)}\nthe fp32 model: {facts['full_model_bytes']:,} B; its largest "
        f"tensor: {facts['largest_param_bytes']:,} B"
    )


def tied_lines(facts: dict[str, Any]) -> list[str]:
    """Each wrap of GPT-2's tied head: still tied after sharding, the first step's error or its losses
    against single's (`single_losses`)."""
    out = []
    for way, label in (("broken", "head in a unit of its own"), ("fixed", "fully_shard([wte, lm_head])")):
        got = facts[way]
        ran = (
            f"error: {got['error']}"
            if got["error"]
            else f"trained; losses against single: largest relative difference "
            f"{largest_relative_difference(got['losses'], facts['single_losses']):.1e}"
        )
        out.append(f"{label}: head tied to the embedding after sharding: {got['tied']}; {ran}")
    return out


def bf16_table(facts: dict[str, Any], lr: float) -> str:
    """The share of weight elements one AdamW step at `lr` left unchanged, bf16 weights against fp32 masters."""
    rows = [("weights AdamW updates", f"unchanged by one step at lr {lr:g}")]
    for way, label in (
        ("broken", "bf16 (model cast before sharding)"),
        ("fixed", "fp32 masters, bf16 compute"),
    ):
        rows.append((f"{label}: {facts[way]['dtype']}", f"{facts[way]['unchanged']:.2%}"))
    return tables.fixed_width(rows, rule=True)


def deepspeed_table(facts: dict[str, Any]) -> str:
    """Peak bytes per rank, the reduce bucket by the engine's accounting and the parameters held, each way."""
    rows = [("run", "peak / rank", "reduce bucket (accounting)", "parameters held")]
    for name, got in facts.items():
        bucket = f"{got['bucket_bytes']:,} B" if "bucket_bytes" in got else "none"
        label = name if name == FSDP2 else f"ZeRO-3, {name}"
        rows.append((label, f"{got['peak_bytes']:,} B", bucket, f"{got['state_bytes']['params']:,} B"))
    return tables.fixed_width(rows, rule=True)


def buffers_figure(facts: dict[str, Any]):
    """Each way's peak bytes per rank (`deepspeed_buffers`), one bar each on a log axis: the reduce bucket at its
    default against the parameters' own bytes."""
    import matplotlib.pyplot as plt

    from labkit import plots  # noqa: F401 (a bare Figure shows as a PNG in a notebook)

    labels = [name if name == FSDP2 else f"ZeRO-3,\n{name}" for name in facts]
    peaks = [got["peak_bytes"] for got in facts.values()]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ax.barh(range(len(peaks)), peaks, color=["#c0392b" if p == max(peaks) else "#2e86c1" for p in peaks])
    ax.set_yticks(range(len(peaks)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("peak live tensor bytes per rank, one step (B, log scale)")
    for y, peak in enumerate(peaks):
        ax.annotate(
            f"{peak:,} B", (peak, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
        )
    ax.set_xlim(min(peaks) / 2, max(peaks) * 20)
    ax.set_title("DeepSpeed's default reduce bucket against the model")
    fig.tight_layout()
    plt.close(fig)
    return fig


def show_figures(figures: dict[str, Any]) -> None:
    """Display every case's facts as JSON (one output the tests read), with a line of text beside it."""
    from IPython.display import display

    data = json.loads(json.dumps(figures, default=str))
    display(
        {"application/json": data, "text/plain": f"the facts of {len(data)} cases, for the tests"}, raw=True
    )
