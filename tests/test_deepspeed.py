"""The deepspeed engine against the single-process AdamW oracle, under `labkit.launch` and its launcher.

DeepSpeed's init costs seconds per engine, so each launch builds several engines in turn: one launch per
world size (`ranks`) serves every rank-side check of this file at that size, and one run of the `deepspeed`
launcher serves both checks under it. Its CPU ops (cpu_adam, shm comm) are JIT-built once into
~/.cache/torch_extensions; the generous timeout covers a first build on a cold cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace

import pytest
from engine_helpers import assert_close, reference_losses
from launches import job, launched_on_demand, train

from labkit.budget import collective_wire_bytes, deepspeed_zero_estimate
from labkit.engines import deepspeed as dse
from labkit.engines import on_rank, validation
from labkit.engines.base import RunConfig
from labkit.engines.ds_config import (
    block_numel,
    ds_config,
    gradient_ready_numels,
    matched_to_fsdp2,
    module_units,
    quantized_weight_fetches,
    reduce_bucket_for_calls,
    reduce_scatters_per_step,
)
from labkit.lessons import deepspeed_inspect, parity
from labkit.model import build_model, count_params
from labkit.probes import Probes
from labkit.probes.memory import STEP_SCALARS

TIMEOUT_S = 600  # a cold ~/.cache/torch_extensions builds DeepSpeed's CPU ops first (~3 min)
BF16_REL = 1e-2  # bf16 compute vs the float32 oracle over 3 steps (measured below 1e-3)


def _variants(cases: list[tuple[str, RunConfig]]) -> dict:
    """Rank side: each case on fresh weights: losses and itemised state, or the error sentence.

    A case with `comms_logger` trains step by step under labkit's probe (installed before DeepSpeed starts,
    as the loop does), and keeps what both instruments saw in each step.
    """
    out = {}
    n_params = count_params(build_model())
    info = on_rank.rank_info()
    probes = Probes(info.rank, info.device)
    for name, cfg in cases:
        logged = cfg.options.get("comms_logger")
        try:
            with probes if logged else nullcontext():
                engine = dse.build(cfg, build_model(cfg.model, cfg.seed), info)
                per_step = _train_beside_comms_logger(engine, cfg, probes) if logged else None
        except ValueError as e:
            out[name] = {"error": str(e)}
            continue
        if per_step is None:
            out[name] = {"losses": on_rank.train_steps(engine, cfg)}
        else:
            out[name] = {"losses": [s["loss"] for s in per_step], "per_step": per_step}
        out[name]["state"] = dse.itemise_state_bytes(engine, n_params)
        out[name]["terms"] = deepspeed_inspect.state_terms(engine, cfg)
    return out


def _logged_sizes() -> dict[str, Counter]:
    """DeepSpeed's comms logger so far (`comms_logger_summary`): per op, calls per message size (bytes)."""
    return {op: Counter(row["calls_by_size"]) for op, row in dse.comms_logger_summary().items()}


def _train_beside_comms_logger(engine, cfg: RunConfig, probes: Probes) -> list[dict]:
    """Train `cfg.steps` steps; per step: the global loss and what each instrument saw in that step.

    "logged": the comms logger's calls per message size, per op; "probed": the probe's calls per payload
    size, per collective kind (bytes). The loss all-reduce of `train_steps` is outside the probe's step and
    not through deepspeed.comm, so neither instrument counts it.
    """
    out = []
    for step in range(cfg.steps):
        before = _logged_sizes()
        [loss] = on_rank.train_steps(engine, replace(cfg, steps=1), first_step=step, probes=probes)
        logged = {op: sizes - before.get(op, Counter()) for op, sizes in _logged_sizes().items()}
        probed: dict[str, Counter] = {}
        for call in probes.comm.calls:
            if call.step == step:
                probed.setdefault(call.kind, Counter())[call.payload_bytes] += 1
        out.append({"loss": loss, "logged": logged, "probed": probed})
    return out


_BASE = RunConfig(world_size=2, steps=3)
VARIANT_CASES = {
    # First: DeepSpeed's backend keeps the torch.distributed functions it finds at its first init, so the
    # probe must be installed then to see its collectives (later cases' calls land in it unread). First in
    # the 2-rank launch too (`ranks`).
    "fp32": replace(_BASE, steps=10, options={"comms_logger": True}),
    "bf16": replace(_BASE, dtype="bfloat16"),
    "offload_optimizer": replace(_BASE, offload="cpu"),
    "offload_all": replace(_BASE, offload="cpu", options={"offload_param": True}),
    "defaults": replace(_BASE, options={"ds_mode": "defaults"}),
    "quantized_weights": replace(_BASE, options={"zero_quantized_weights": True}),
    "quantized_gradients": replace(_BASE, options={"zero_quantized_gradients": True}),
}


def test_deepspeed_matches_single_with_each_option_on_two_ranks(ranks):
    cases = VARIANT_CASES
    got = ranks(2)["variants"]
    for name in ("fp32", "offload_optimizer", "offload_all", "defaults"):
        assert_close(got[name]["losses"], reference_losses(cases[name]))
    assert_close(got["bf16"]["losses"], reference_losses(replace(cases["bf16"], dtype="float32")), BF16_REL)

    for flag in ("quantized_weights", "quantized_gradients"):
        message = got[flag]["error"]
        assert message.startswith(f"zero_{flag}=True does not run on CPU ranks: ") and "\n" not in message

    # State per rank, in B/param x n: fp32 4 + 4 (master copy) + 4 (grads) + 8 (AdamW) = 20 plus the reduce
    # bucket (one block's worth) and AdamW's 4-byte step; bf16 2 + 4 + 2 + 8 = 16 plus the bucket.
    n, n_params = 2, count_params(build_model())
    for name, grad_bytes, param_bytes in (("fp32", 4, 4), ("bf16", 2, 2)):
        rows = {(r["state"], r["what"]): r["bytes"] for r in got[name]["state"]}
        assert rows == {
            ("params", "parameter partition"): param_bytes * n_params // n,
            ("grads", "gradient partitions (flat)"): grad_bytes * n_params // n,
            ("grads", "reduce bucket (flat)"): grad_bytes * block_numel("tiny"),
            ("optimizer", "fp32 master partition (flat)"): 4 * n_params // n,
            ("optimizer", "AdamW exp_avg"): 4 * n_params // n,
            ("optimizer", "AdamW exp_avg_sq"): 4 * n_params // n,
            ("optimizer", STEP_SCALARS): 4,  # one flat parameter group, one AdamW step scalar
        }, name
    # Every case's terms, from the config, equal the measured ones and sum to the probe's state bytes; the
    # optimizer offload keeps the host optimizer's fp32 gradient (4 B/param / n) between steps too.
    for name in ("fp32", "bf16", "offload_optimizer", "offload_all", "defaults"):
        _assert_terms_sum_to_the_measurement(got[name]["terms"], name)
    assert got["offload_optimizer"]["terms"]["terms"]["fp32 gradient of the master partition (offload)"] == (
        4 * n_params // n
    )
    # DeepSpeed's defaults keep every parameter of the tiny model (all under 1e5 elements) whole on every
    # rank, and a reduce bucket of 5e8 elements.
    rows = {(r["state"], r["what"]): r["bytes"] for r in got["defaults"]["state"]}
    assert rows[("params", "persistent full copy")] == 4 * n_params
    assert rows[("grads", "reduce bucket (flat)")] == 4 * 500_000_000

    # DeepSpeed's comms logger beside labkit's probe, step by step, call sizes included. The logger's
    # all-gather "message" is the input shard, 1/n of the probe's payload (the gathered output); a
    # reduce-scatter's is the full input, as is an all-reduce's or a broadcast's: the probe's payload.
    # Every DeepSpeed collective goes through deepspeed.comm, so both see the same calls.
    for step, seen in enumerate(got["fp32"]["per_step"]):
        logged, probed = seen["logged"], seen["probed"]
        assert probed["all_gather"] == Counter(
            {size * n: calls for size, calls in logged["all_gather_into_tensor"].items()}
        ), step
        assert probed["reduce_scatter"] == logged["reduce_scatter_tensor"], step
        assert probed["all_reduce"] == logged["all_reduce"] == Counter({8: 1}), step  # the gradient norm
        assert probed.get("broadcast", Counter()) == logged.get("broadcast", Counter()), step
        assert set(probed) <= {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}
        # The logger's totals against the formula (tiny divides by 2: no padding): with the fair knobs every
        # parameter is gathered for forward and again for backward, and reduce-scattered once.
        param_bytes = 4 * n_params
        assert sum(s * c for s, c in logged["all_gather_into_tensor"].items()) * n == 2 * param_bytes
        assert sum(s * c for s, c in logged["reduce_scatter_tensor"].items()) == param_bytes


def _assert_terms_sum_to_the_measurement(state: dict, name: str) -> None:
    """`deepspeed_inspect.state_terms`: measured terms = accounting, summing to the probe; only scalars left."""
    assert state["terms"] == state["accounting"], name
    assert sum(state["terms"].values()) == state["measured_bytes"], name
    assert set(state["outside_state"]) == {f"optimizer.{k}" for k in deepspeed_inspect.NOT_CARRIED}, name
    assert sum(state["outside_state"].values()) <= 9, name  # an 8- (or 4-) byte norm and a 1-byte flag


def test_deepspeed_extra_copy_itemised_at_four_ranks(ranks):
    # Issue 19, item 1: fp32 ZeRO-3 at 4 ranks keeps 20 B/param / n (4 params + 4 grads + 4 fp32 master +
    # 8 AdamW) plus a reduce bucket of one block and AdamW's 4-byte step: about 1.48 x 16 B/param / n.
    n, n_params = 4, count_params(build_model())
    state = ranks(4)["itemised"]
    _assert_terms_sum_to_the_measurement(state, "fp32 at 4 ranks")
    assert state["paper_bytes"] == 16 * n_params / n
    assert state["measured_bytes"] == 20 * n_params // n + 4 * block_numel("tiny") + 4
    assert state["ratio_to_paper"] == pytest.approx(1.4787, abs=1e-4)


LOOP_CASES = [
    (2, {}),
    (3, {"steps": 10}),  # with n=2 above (10 steps) and n=4 in test_compare_cli: issue 4's acceptance
    (3, {"model": "tiny_uneven"}),
    (4, {"options": {"zero_hpz_partition_size": 2}}),
    (2, {"options": {"ds_mode": "defaults"}}),
    (2, {"dtype": "bfloat16"}),
]


def _loop_cfg(n: int, kw: dict) -> RunConfig:
    return replace(RunConfig(world_size=n, steps=3), **kw)


NVME = RunConfig(model="small", world_size=2, steps=2, offload="nvme", options={"offload_param": True})


def deepspeed_jobs(n: int) -> dict:
    """Every rank-side job of this file at `n` ranks, in launch order: at 2, `_variants` first (see
    VARIANT_CASES); at 4, the hpZ run last (DeepSpeed keeps its hpZ groups for the process, see run_many)."""
    jobs = {"variants": job(_variants, list(VARIANT_CASES.items()))} if n == 2 else {}
    if n == 4:
        jobs["itemised"] = job(deepspeed_inspect.itemise_state, RunConfig(world_size=n, steps=2))
    hpz = [i for i, (_, kw) in enumerate(LOOP_CASES) if "zero_hpz_partition_size" in kw.get("options", {})]
    for i in sorted(range(len(LOOP_CASES)), key=lambda i: i in hpz):
        if LOOP_CASES[i][0] == n:
            jobs[f"loop {i}"] = train("deepspeed", _loop_cfg(*LOOP_CASES[i]))
    if n == 2:
        jobs["nvme"] = job(_nvme_rank, NVME, per_rank=True)
    return jobs


@pytest.fixture(scope="module")
def ranks():
    """`get(n)`: {job name: result} of `deepspeed_jobs(n)`, launched the first time a test asks for `n`."""
    return launched_on_demand(deepspeed_jobs, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case", range(len(LOOP_CASES)), ids=[f"{n}-{kw}" for n, kw in LOOP_CASES])
def test_deepspeed_bytes_through_the_loop_match_the_plan(case, ranks):
    # The comm record is the last step's: from step 2 on DeepSpeed has traced its order (steady state).
    n, kw = LOOP_CASES[case]
    cfg = _loop_cfg(n, kw)
    record = ranks(n)[f"loop {case}"]
    unsharded = build_model(cfg.model)
    rel = BF16_REL if cfg.dtype == "bfloat16" else 1e-4
    assert_close(record["losses"], reference_losses(replace(cfg, dtype="float32")), rel)
    comm = record["comm"]
    assert set(comm) == {"all_gather", "reduce_scatter", "all_reduce"}
    # The only all-reduce: the 8-byte global gradient norm.
    assert comm["all_reduce"]["payload_bytes"] == 8
    predicted = dse.predicted_wire_bytes(unsharded, cfg, n)
    assert comm["all_gather"]["wire_bytes"] == predicted["all_gather"]
    assert comm["reduce_scatter"]["wire_bytes"] == predicted["reduce_scatter"]
    # Against the formula: reduce-scatter (n-1)/n x padded parameter bytes (bf16 runs reduce in bf16).
    elem_bytes = 2 if cfg.dtype == "bfloat16" else 4
    padded_bytes = elem_bytes * sum(-(-p.numel() // n) * n for p in unsharded.parameters())
    once = collective_wire_bytes("all_gather", padded_bytes, n)
    assert comm["reduce_scatter"]["wire_bytes"] == once
    if cfg.options.get("ds_mode") == "defaults":
        # Every parameter is persistent (all under 1e5 elements): gathered once per step, after the optimizer
        # step, never before backward; the step moves 2/3 of ZeRO-3's 3 x (n-1)/n x parameter bytes.
        assert comm["all_gather"]["wire_bytes"] == once
    elif "zero_hpz_partition_size" in cfg.options:
        # Backward gathers inside pairs from the secondary partition: (1/2) instead of (n-1)/n.
        assert comm["all_gather"]["wire_bytes"] == once + padded_bytes // 2
    else:
        assert comm["all_gather"]["wire_bytes"] == 2 * once


def test_memory_estimator_is_deepspeeds_own_arithmetic():
    model = build_model()
    est = dse.memory_estimate(model, 4)
    assert est["bytes_per_param_times_n"] == pytest.approx(18, rel=1e-6)
    restated = deepspeed_zero_estimate(est["params"], est["largest_layer_params"], num_gpus_per_node=4)
    assert est["gpu_bytes_per_rank"] == restated["gpu_bytes_per_rank"]


def test_config_is_fair_by_default_and_refuses_what_it_cannot_do():
    zero = ds_config(RunConfig(world_size=2), 2)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 0 and zero["stage3_max_live_parameters"] == 1
    assert ds_config(RunConfig(world_size=2), 2)["gradient_clipping"] == 0.0
    assert (
        "stage3_param_persistence_threshold"
        not in ds_config(RunConfig(), 2, mode="defaults")["zero_optimization"]
    )
    with pytest.raises(ValueError, match="ds_mode='nope'"):
        ds_config(RunConfig(options={"ds_mode": "nope"}), 2)
    with pytest.raises(ValueError, match="does not divide the global batch"):
        ds_config(RunConfig(), 5)


def _under_deepspeed_launcher(script) -> str:
    """Run `script` on 2 CPU ranks under the `deepspeed` launcher; its stdout (it must exit 0).

    Each run gets a port of its own: DeepSpeed's CPU all-reduce names its /dev/shm buffers after the master
    port and leaves them behind, so with the launcher's fixed default (29500) every run would map the
    buffers of the runs before it. They are removed after the run."""
    import glob
    import socket

    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        done = subprocess.run(
            [launcher, "--num_gpus", "2", "--master_port", str(port), str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.remove(path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# One run of the launcher for both of its checks (starting it costs seconds): first `train_steps` through
# `labkit.launch` in place, then `loop.run` of the plain and the qgZ runs with labkit's refusal lifted.
UNDER_LAUNCHER = """
import json, os, sys
import labkit
from labkit import cluster
from labkit.engines import deepspeed as dse, loop, on_rank
from labkit.engines.base import RunConfig
from labkit.model import build_model

def fn(cfg):
    return on_rank.train_steps(dse.build(cfg, build_model(), on_rank.rank_info()), cfg)

losses = labkit.launch(fn, 2, RunConfig(world_size=2, steps=3))
if os.environ["RANK"] == "0":
    print("LOSSES", losses[0])

dse.refuse_cuda_only_flags = lambda cfg: None  # let DeepSpeed itself decide what the flag does
cases = {"plain": {}, "qgz": {"zero_quantized_gradients": True}}
records = {k: loop.run("deepspeed", RunConfig(world_size=2, steps=3, options=v)) for k, v in cases.items()}
if os.environ["RANK"] == "0":
    kept = {k: {"losses": r["losses"], "comm": r["comm"]} for k, r in records.items()}
    sys.stdout.write("RECORDS " + json.dumps(kept) + "\\n")
cluster.leave_launched_rank(0)
"""


@pytest.fixture(scope="module")
def launcher_stdout(tmp_path_factory) -> str:
    """Rank 0's stdout of UNDER_LAUNCHER on 2 CPU ranks under the `deepspeed` launcher."""
    script = tmp_path_factory.mktemp("launcher") / "run.py"
    script.write_text(UNDER_LAUNCHER)
    return _under_deepspeed_launcher(script)


def test_deepspeed_runs_under_the_deepspeed_launcher(launcher_stdout):
    line = next(x for x in launcher_stdout.splitlines() if "LOSSES" in x)
    losses = [float(v) for v in line.split("LOSSES", 1)[1].strip(" []").split(",")]
    assert_close(losses, reference_losses(RunConfig(steps=3)))


def _nvme_rank(cfg: RunConfig) -> dict:
    engine = dse.build(cfg, build_model(cfg.model, cfg.seed), on_rank.rank_info())
    losses = on_rank.train_steps(engine, cfg)
    rows = {(r["state"], r["what"]): r["bytes"] for r in dse.itemise_state_bytes(engine, 1)}
    files = engine.swap_file_bytes()
    return {"losses": losses, "rows": rows, "files": files, "swap_dir": engine.swap_dir}


def test_nvme_offload_keeps_the_optimizer_state_in_files_and_the_losses(ranks):
    # `small`: on `tiny` every partition is under DeepSpeed's 1 MiB swap minimum and NVMe changes nothing.
    cfg = NVME
    got = ranks(2)["nvme"]
    assert_close(got[0]["losses"], reference_losses(cfg))
    n_params, n = count_params(build_model("small")), 2
    for rank in got:
        # In memory between steps: no fp32 master partition, no moments; in this rank's files: the master
        # partition and both moments (12 B/param / n) at least.
        assert rank["rows"][("optimizer", "fp32 master partition (flat)")] == 0
        assert (
            rank["rows"][("optimizer", "AdamW exp_avg")]
            == rank["rows"][("optimizer", "AdamW exp_avg_sq")]
            == 0
        )
        assert rank["files"]["optimizer"] >= 12 * n_params // n
    # The swap folder lived inside the launch's run folder and went with it.
    swap_dir = got[0]["swap_dir"]
    assert os.path.basename(os.path.dirname(swap_dir)).startswith("labkit-launch-")
    assert not os.path.exists(swap_dir)


def test_qwz_on_gpu_ranks_without_a_built_quantizer_is_refused_in_one_sentence(tmp_path):
    from labkit.engines import deepspeed as dse

    qwz = RunConfig(options={"zero_quantized_weights": True})
    with pytest.raises(ValueError) as refused:
        dse.refuse_unbuilt_quantizer(qwz, accelerator="cuda", ext_dir=str(tmp_path))
    said = str(refused.value)
    assert said.startswith(
        "zero_quantized_weights=True needs DeepSpeed's CUDA quantizer op, and it is missing"
    )
    assert "python -m labkit.prebuild" in said and "\n" not in said
    (tmp_path / "quantizer").mkdir()
    (tmp_path / "quantizer" / "quantizer.so").write_bytes(b"")  # built at set-up: nothing to say
    dse.refuse_unbuilt_quantizer(qwz, accelerator="cuda", ext_dir=str(tmp_path))
    dse.refuse_unbuilt_quantizer(RunConfig(), accelerator="cuda", ext_dir=str(tmp_path / "none"))  # no ZeRO++
    dse.refuse_unbuilt_quantizer(qwz, accelerator="cpu")  # CPU ranks: refuse_cuda_only_flags says why


def test_nvme_config_and_its_refusals():
    zero = ds_config(RunConfig(offload="nvme", options={"nvme_path": "/x"}), 2)
    assert zero["zero_optimization"]["offload_optimizer"] == {
        "device": "nvme",
        "pin_memory": False,
        "nvme_path": "/x",
    }
    # The aio block exceeds the largest fp32 gradient partition (small: 1,572,864 elements / 2 ranks x 4 B).
    assert (
        zero["aio"]["block_size"] == 2**20
        and ds_config(RunConfig(model="small", offload="nvme"), 2)["aio"]["block_size"] == 4 * 2**20
    )
    with pytest.raises(ValueError, match="only the deepspeed engine swaps to files"):
        validation.validate(["single", "fsdp2"], RunConfig(offload="nvme"))
    validation.validate(["single", "deepspeed"], RunConfig(offload="nvme"))


def test_quantized_gradients_under_the_deepspeed_launcher_on_cpu_change_nothing_the_probes_see(
    launcher_stdout,
):
    """qgZ accepted but a no-op: under the `deepspeed` launcher on one CPU node, DeepSpeed takes
    `zero_quantized_gradients` and runs the plain reduce-scatter. labkit refuses the flag on CPU (it does
    nothing there); with the refusal lifted, the probes see the very same collectives and bytes, and the
    losses are the plain run's."""
    line = next(x for x in launcher_stdout.splitlines() if x.startswith("RECORDS "))
    records = json.loads(line.removeprefix("RECORDS "))
    plain, qgz = records["plain"], records["qgz"]
    assert "all_to_all" not in qgz["comm"] and plain["comm"]["reduce_scatter"]["wire_bytes"] > 0
    assert qgz["comm"] == plain["comm"]  # no all-to-all, no quantized (smaller) payload: the same bytes
    assert_close(qgz["losses"], plain["losses"], rel=0.0)


def test_deepspeed_matched_to_fsdp2_issues_the_same_collectives():
    # Issue 19, item 3: each block a DeepSpeed leaf module and a reduce bucket sized by DeepSpeed's own rule
    # give FSDP2-at-module-units' calls per step: 2 x 8 all-gathers and 8 reduce-scatters on tiny, the same
    # wire bytes (tiny divides by 2: no padding on either side), plus DeepSpeed's 8-byte gradient-norm
    # all-reduce. Without the leaf blocks DeepSpeed gathers every sub-module: 64 calls.
    assert (
        ds_config(RunConfig(options=matched_to_fsdp2("tiny")), 2)["zero_optimization"]["reduce_bucket_size"]
        == 74_400
    )
    result = parity.run_parity(RunConfig(world_size=2, steps=3), repeats=1, timeout_s=TIMEOUT_S)
    engines = result["engines"]
    for row in engines.values():
        assert_close(row["losses"], reference_losses(RunConfig(steps=3)))
    units = module_units("tiny")
    assert engines[parity.FSDP2_BLOCKS]["calls"] == {"all_gather": 2 * 4 + 1, "reduce_scatter": 4 + 1}
    assert engines[parity.FSDP2_MODULES]["calls"] == {"all_gather": 2 * units, "reduce_scatter": units}
    ds = engines[parity.DEEPSPEED_MATCHED]
    assert ds["calls"] == {"all_gather": 2 * units, "reduce_scatter": units, "all_reduce": 1}
    # The same bytes, and the gradient norm's all-reduce: 2 (n-1)/n x 8 B = 8 B on the wire at n = 2.
    assert ds["wire_bytes"] == {**engines[parity.FSDP2_MODULES]["wire_bytes"], "all_reduce": 8}
    table = parity.parity_table(result).splitlines()
    assert [line.split(",")[0] for line in table[1:4]] == ["fsdp2", "fsdp2", "deepspeed"]
    assert result["ratio"]["median"] == ds["step_s"] / engines[parity.FSDP2_MODULES]["step_s"]


def test_reduce_bucket_rule_counts_deepspeeds_flushes():
    # DeepSpeed flushes before a gradient that would overflow a non-empty bucket, and once at the end.
    assert reduce_scatters_per_step([5, 5, 5], 10) == 2
    assert reduce_scatters_per_step([5, 20, 5], 10) == 3  # a gradient above the bucket goes alone
    # Measured on tiny (2 ranks, DeepSpeed 0.19.8): 5 reduce-scatters with one block's bucket, 7 with 80,000.
    order = gradient_ready_numels("tiny")
    assert sum(order) == count_params(build_model())
    assert reduce_scatters_per_step(order, block_numel("tiny")) == 5
    assert reduce_scatters_per_step(order, 80_000) == 7
    with pytest.raises(ValueError, match="no reduce_bucket_size makes DeepSpeed reduce-scatter 100 times"):
        reduce_bucket_for_calls("tiny", 100)


def test_qwz_quantises_every_weight_fetch_of_the_installed_deepspeed():
    # Issue 29, item 4: `labkit.budget` prices qwZ on both weight all-gathers because DeepSpeed's fetch passes the
    # config's flag whether it fetches for forward or for backward (read from its source: no CUDA kernel here).
    assert quantized_weight_fetches() == ["True", "self.zero_quantized_weights"]
