"""The course notebooks: committed clean, executed headless, their key outputs checked (decks: test_slides.py).

Every notebook in notebooks/ is executed once per session with papermill by the `executed` fixture
(tests/conftest.py, shared with tests/test_claims.py); the tests below read the executed copies. Their wall times
are printed at the end of the session. The cells tagged
`nbval-check-output` (deterministic budget cells) are then re-run by nbval (`--nbval-lax`) in a fresh
kernel against the papermill run's outputs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import verdict_checker
from prose import TYPED_FIGURE

from labkit import KERNEL_NAME, budget

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CHECK_TAG = "nbval-check-output"


def _text(nb: nbformat.NotebookNode) -> str:
    """Every stream, plain-text and error output of an executed notebook, joined."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append(o.text)
            elif o.output_type in ("execute_result", "display_data"):
                out.append(o.get("data", {}).get("text/plain", ""))
            elif o.output_type == "error":
                out.append(f"{o.ename}: {o.evalue}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ committed state


@pytest.mark.parametrize("name", ALL)
def test_committed_notebook_is_clean_and_has_parameters_and_slides(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == KERNEL_NAME
    for i, cell in enumerate(nb.cells):
        assert "slideshow" in cell.metadata, f"{name} cell {i} has no slideshow metadata"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name} cell {i} has outputs: strip them before committing"
            assert cell.execution_count is None, f"{name} cell {i} has an execution count"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one papermill `parameters` cell"
    assert re.search(r"^world_size\s*=", tagged[0].source, re.M), (
        f"{name}: parameters cell sets no world_size"
    )
    assert nb.cells[0].cell_type == "markdown" and "How long" in nb.cells[0].source


@pytest.mark.parametrize("name", ALL)
def test_each_notebook_predicts_twice_names_its_exercise_and_types_no_figure(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    predicts = [c for c in nb.cells if "predict" in c.metadata.get("tags", [])]
    assert len(predicts) >= 2, f"{name} has {len(predicts)} `predict` cells; the course asks for two or more"
    assert all("predict(" in c.source for c in predicts), f"{name}: a `predict` cell that asks nothing"
    reveals = sum(c.source.count(".reveal(") for c in nb.cells if c.cell_type == "code")
    assert reveals >= len(predicts), f"{name}: {len(predicts)} predictions but {reveals} reveals"
    prose = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert any(re.search(r"\]\(\.\./exercises/\d\d_\w+\.ipynb\)", s) for s in prose), (
        f"{name} links to no exercise"
    )
    assert re.search(r"(?i)remember", prose[-1]), f"{name} does not end with the one thing to remember"
    typed = [(i, m.group(0)) for i, s in enumerate(prose) for m in TYPED_FIGURE.finditer(s)]
    assert not typed, f"{name}: figures typed into markdown (render them from the run): {typed[:4]}"


def test_the_typed_figure_scan_finds_rates_and_ratios_but_not_formulas():
    found = [m.group(0) for m in TYPED_FIGURE.finditer("at 50 GB/s, 989 TFLOP/s, 1.48x, 3.6 s and 93% of it")]
    assert found == ["50 GB/s", "989 TFLOP/s", "1.48x", "3.6 s", "93%"]
    assert not TYPED_FIGURE.search("16 B/param / n, 3 x (n-1)/n x 2N, 30B params on 512 GPUs")


@pytest.mark.parametrize("name", ALL)
def test_cheat_sheet_types_no_figure(name):
    """A cheat sheet quotes its figure from the executed notebook (`{{figure}}`); its prose types none."""
    from labkit.slides import FIGURE_SPEC, default_cheatsheets_dir

    prose = FIGURE_SPEC.sub(
        "", (default_cheatsheets_dir() / name.replace(".ipynb", ".md")).read_text(), count=1
    )
    typed = [m.group(0) for m in TYPED_FIGURE.finditer(prose)]
    assert not typed, f"{name}'s cheat sheet types figures (quote them via its figure line): {typed[:4]}"


def test_course_has_notebooks_00_to_09():
    assert [n[:2] for n in ALL] == [f"{i:02d}" for i in range(10)]


# ------------------------------------------------------------------------------------------ execution


@pytest.mark.parametrize("name", ALL)
def test_notebook_runs_without_error(executed, name):
    nb = executed(name)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{name}: {errors[0].ename}: {errors[0].evalue}"


@pytest.mark.parametrize("name", ALL)
def test_every_prediction_is_revealed_under_papermill(executed, name):
    """Under papermill nobody types: each reveal still shows its measurement and says none was entered."""
    nb = executed(name)
    asked = [c for c in nb.cells if "predict" in c.metadata.get("tags", [])]
    text = _text(nb)
    assert text.count("No prediction entered") >= len(asked), f"{name}: a prediction was never revealed"
    assert all(c.outputs for c in asked), f"{name}: a `predict` cell shows nothing"


def test_00_draws_what_each_rank_holds_before_and_after_each_collective(executed):
    assert _figures(executed("00_start_here.ipynb"), "75426772") == 2  # the all-gather, the reduce-scatter


def test_01_ratios_and_budget(executed):
    text = _text(executed("01_memory.ipynb"))
    ratios = [float(x) for x in re.findall(r"^\s*\w+\s+[\d,]+\s+[\d,]+\s+(\d\.\d{3})$", text, re.M)]
    assert ratios and all(1.0 <= r < 1.6 for r in ratios), ratios
    p = budget.plan(30e9, 256, "zero3")
    assert f"zero3: {budget.format_bytes(p['state_bytes_per_rank'])} per rank" in text
    assert budget.format_bytes(p["static_bytes_total"]) in text
    # every byte above the formula is itemised from the run: AdamW's step scalars, DeepSpeed's own buffers
    above = dict(re.findall(r"^\s*(\w+): +[\d,]+ B above the formula = (.*)$", text, re.M))
    assert above["scratch"] == "nothing" and "fp32 master partition" in above["deepspeed"], above
    assert "not itemised" not in text
    # checkpointed, DDP (nothing above its state but activations) falls as the budget's activations do
    ddp = re.search(r"^\s*ddp: peak - state .*\((\d\.\d\d)x; budget's activations (\d\.\d\d)x\)", text, re.M)
    assert ddp and float(ddp[1]) == pytest.approx(float(ddp[2]), rel=0.05), text


def test_02_loss_equality_and_bytes_formula(executed):
    text = _text(executed("02_zero3_from_scratch.ipynb"))
    assert "Not yet: the runs below train" not in text  # the loop trained the notebook's own build cells
    worst = float(re.search(r"largest relative difference: (\S+)", text).group(1))
    assert worst < 1e-4
    ratios = re.findall(r"ratio (\d\.\d{4})", text)
    assert ratios and set(ratios) == {"1.0000"}, ratios


def test_03_scale_model_is_budgets(executed):
    from labkit.engines import scratch
    from labkit.engines.base import RunConfig
    from labkit.model import build_model

    text = _text(executed("03_prefetch_overlap.ipynb"))
    big = budget.plan(30e9, 256, "zero3", tokens_per_rank=16384, link_gbytes=50, peak_tflops=989, mfu=0.4)
    assert f"{budget.format_bytes(big['traffic_bytes_per_rank'])}" in text
    assert f"{big['comm_time_s']:.2f} s" in text and f"{big['compute_time_s']:.2f} s" in text
    # Issue 41: every timing verdict holds against the figures printed with it (medians and IQRs over the
    # interleaved rounds), and rank 0's computing time (waits cut out) and its waits make up its own step in each
    # step drawn (the slowest rank's step is longer by however late the other rank ran: not rank 0's to account for).
    checked = verdict_checker.check(text)
    assert sorted(checked) == ["busy", "drawn", "drawn", "floor", "prefetch"], (checked, text)
    # Issue 28: with prefetch the learner predicts the floor, the collectives with nothing beside them, which
    # labkit computes from the unit plan; the formula they can write (those bytes / the link) equals it, and
    # the measured exposed time is then set against it. Under papermill nobody predicted: no mistake is named.
    assert "nothing to hide behind: input forward all-gather; blocks.0 forward all-gather; blocks.0 " in text
    floor = re.search(
        r"the collectives with no compute beside them, on this link\): computed (\S+) ms\.", text
    )
    formula = re.search(
        r"Formula their wire bytes \(([\d,]+) B\) / the link's bandwidth = (\S+) ms: equal\.", text
    )
    assert floor and formula and floor.group(1) == formula.group(2), text
    units = {u.name: u for u in scratch.unit_costs(build_model("tiny"), RunConfig(world_size=2), 2)}
    exposed = sum(units[u].gather_wire_bytes + units[u].reduce_wire_bytes for u in ("input", "blocks.0"))
    assert int(formula.group(1).replace(",", "")) == exposed
    assert "No prediction entered" in text and "The usual mistake" not in text


def test_04_offload_scale_model_and_measured(executed):
    text = _text(executed("04_offload.ipynb"))
    p = budget.plan(70e9, 8, "zero3", offload_optimizer="cpu", layers=80, largest_layer_params=int(70e9 / 80))
    assert f"{budget.format_bytes(p['gpu_bytes_per_rank'])}" in text
    assert "ZeRO-3, nothing offloaded              does NOT fit" in text
    rows = dict(re.findall(r"^(scratch(?:, offload)?)\s+[\d,]+\s+([\d,]+)", text, re.M))
    assert int(rows["scratch, offload"].replace(",", "")) == 0 < int(rows["scratch"].replace(",", ""))
    assert "largest relative loss difference to the scratch run: 0.0e+00" in text
    # ZeRO-Infinity for real: the master partition and both moments (12 B/param / n) in rank 0's files.
    assert re.search(r"swap files, optimizer: [\d,]+ B = 12\.\d B/param / n", text)
    assert "in memory, optimizer state: 4 B (only AdamW's step counter" in text  # STEP_SCALAR_BYTES
    assert float(re.search(r"difference to single: (\S+)", text).group(1)) < 1e-5
    # DeepSpeed's state rises under optimizer offload by the fp32 gradient partition it keeps for CPU Adam
    rise = re.search(
        r"\(\+([\d,]+) B\); an fp32 copy of this rank's [\d,]+-element gradient partition: ([\d,]+) B", text
    )
    assert rise and rise[1] == rise[2], text


def test_05_fsdp2_features(executed):
    text = _text(executed("05_fsdp2_surface.ipynb"))
    # the learner's fully_shard build cell (filled in this copy) passes each property its check names
    assert all(f"✓ {prop}:" in text for prop in ("placements", "prefetch", "losses", "bytes")), text
    # a Hugging Face model: the learner's 02 pieces (filled here), FSDP2 and DeepSpeed, each equal to single
    hf = dict(re.findall(r"^(yours|fsdp2|deepspeed)\s+\d\.\d{6}\s+(\S+)", text, re.M))
    assert set(hf) == {"yours", "fsdp2", "deepspeed"} and max(map(float, hf.values())) < 1e-4, hf
    assert "(Shard(dim=0),)" in text and "(Replicate(), Shard(dim=0))" in text
    assert text.count(": True") >= 4  # every block's all-gather at its policy's width
    diffs = [float(x) for x in re.findall(r"largest relative difference to single (\S+)", text)]
    assert len(diffs) >= 5 and max(diffs) < 5e-3, diffs  # bf16 blocks: bf16 rounding; fp32 runs: ~1e-7
    assert re.search(r"largest weight difference 0\.0e\+00", text)
    resumed = re.search(r"uninterrupted: (\[.*\])\nresumed      : (\[.*\])", text)
    before, after = (json.loads(resumed.group(i)) for i in (1, 2))
    assert max(abs(a - b) / b for a, b in zip(before, after, strict=True)) < 1e-5, (before, after)
    assert "1 pre_forward lines" not in text.split("root only")[0]  # the correct wrap logs every block
    assert "all-gathers in the step: 1, " in text and "= 100% of the model's parameters" in text
    assert re.search(r"--- one rank: [1-9]\d* pre_forward lines, all-gathers in the step: 0 ", text), text
    # labkit's own ZeRO-3 on PyTorch's nn.TransformerEncoder (widths 3 ranks do not divide): = single, bytes.
    encoder = re.search(r"losses \[.*\] vs single: largest relative difference (\S+)", text)
    assert encoder and float(encoder.group(1)) < 1e-4, text
    assert re.search(r"^reduce_scatter\s+measured .* equal$", text, re.M) and "DIFFERENT" not in text
    assert _figures(executed("05_fsdp2_surface.ipynb"), "51152809") == 1  # the HSDP and TP+FSDP meshes


def _figures(nb: nbformat.NotebookNode, cell_id: str) -> int:
    """How many PNG figures the cell `cell_id` of an executed notebook displayed."""
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def test_06_deepspeed_knobs_and_scale(executed):
    text = _text(executed("06_deepspeed_surface.ipynb"))
    # DeepSpeed's ops were built at set-up: its cold starts in the notebooks load them and build nothing.
    assert executed.built_ops and executed.built_ops_now() == executed.built_ops
    assert '"stage": 3' in text
    fair = re.search(r"^fair\s+(\d+)\s+([\d,]+)\s+([\d,]+)", text, re.M)
    assert fair and fair.group(2) == fair.group(3), "fair DeepSpeed all-gather bytes == its formula"
    plain = budget.plan(30e9, 256, "zero3")["traffic_bytes_by_link"]["inter_node"]
    allthree = budget.plan(30e9, 256, "zero3", qwz=True, hpz=True, qgz=True)["traffic_bytes_by_link"][
        "inter_node"
    ]
    assert f"({plain / allthree:.2f}x less)" in text
    assert "over ranks (0, 1)" in text  # hpZ's backward all-gather inside the emulated node


def test_07_table_and_scale_numbers_are_budgets(executed):
    text = _text(executed("07_head_to_head.ipynb"))
    # Before the 512-GPU plans: the calibrated plan's step against each engine's measured step (issue 23).
    predicted = re.findall(
        r"^(scratch|fsdp1|fsdp2|deepspeed)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s+(\d+\.\d\d)$", text, re.M
    )
    assert {row[0] for row in predicted} == {"scratch", "fsdp1", "fsdp2", "deepspeed"}, predicted
    for _, measured_s, predicted_s, ratio in predicted:
        assert abs(float(predicted_s) / float(measured_s) - float(ratio)) < 0.01 and float(predicted_s) > 0
    assert "The calibrated plan predicted each engine's step on this machine within" in text
    for engine in ("scratch", "fsdp2", "deepspeed"):
        row = re.search(rf"^{engine}\s+\S+\s+(\S+)", text, re.M)
        assert row and float(row.group(1)) < 1e-4, f"{engine} loss must match single"
    # Your engine from 02 (issue 43): its row measured by the same probes, its bytes ZeRO-3's formula exactly.
    from labkit.buildalong.verdicts import formula_wire_bytes

    yours = re.search(r"^yours\s+\S+\s+(\S+)\s+([\d,]+)\s+([\d,]+)", text, re.M)
    formula = formula_wire_bytes("tiny", 2)
    assert yours and float(yours.group(1)) < 1e-4, text
    assert [int(yours.group(i).replace(",", "")) for i in (2, 3)] == [
        formula["all_gather"],
        formula["reduce_scatter"],
    ]
    assert "Your engine trained to single's losses" in text
    h = budget.plan(30e9, 512, "hsdp", group_size=8)
    f = budget.plan(30e9, 512, "zero3")
    assert (
        f"each rank holds 1/{h['shard_ways']['weights']} of the state ({budget.format_bytes(h['state_bytes_per_rank'])})"
        in text
    )
    assert f"1/{f['shard_ways']['weights']} ({budget.format_bytes(f['state_bytes_per_rank'])})" in text
    assert f"{h['copies_in_cluster']['weights']} copies of the model" in text
    html = "".join(
        o.get("data", {}).get("text/html", "")
        for c in executed("07_head_to_head.ipynb").cells
        for o in c.get("outputs", [])
    )
    assert "<details" in html and "shard_placement_fn returns a Shard" in html  # issue 29, item 3
    assert "No prediction entered" in text and "The usual mistake" not in text


def test_07_state_prediction_step_scalars_and_the_parity_verdict(executed):
    """Issues 28 and 29: DeepSpeed / FSDP2 state against a formula the learner can write; AdamW's step scalars
    (4 B per tensor the optimizer updates) by engine, against the measured state; a parity verdict from an interval."""
    from labkit.model import build_model

    text = _text(executed("07_head_to_head.ipynb"))
    ratio = re.search(
        r"multiple of FSDP2's: measured (\S+) x\.\n.*\nFormula \(20 B x P/n .*= (\S+) x: equal\.", text
    )
    assert ratio and ratio.group(1) == ratio.group(2), text
    model = build_model("tiny")
    optimizer_tensors = {
        "scratch": 0,
        "fsdp1": len(model.blocks) + 1,
        "fsdp2": len(list(model.parameters())),
        "deepspeed": 1,
    }
    for engine, tensors in optimizer_tensors.items():
        row = re.search(
            rf"^{engine}\s+state .* AdamW step scalars\s+(\d+) B = 4 B x (\d+)\s.*accounting = measured",
            text,
            re.M,
        )
        assert row and int(row.group(1)) == 4 * tensors == 4 * int(row.group(2)), (engine, text)
    # FSDP2 above FSDP1 by the step scalars, all of the measured gap: nothing is padded on tiny at n = 2.
    gap = re.search(
        r"FSDP2 against FSDP1: state \+([\d,]+) B, of which AdamW's step scalars \+([\d,]+) B .*: the whole gap",
        text,
    )
    steps = 4 * (optimizer_tensors["fsdp2"] - optimizer_tensors["fsdp1"])
    assert gap and int(gap.group(1).replace(",", "")) == int(gap.group(2).replace(",", "")) == steps, text
    assert "padded elements: 0 in FSDP2's shards, 0 in FSDP1's flat buffers" in text
    # The verdict rests on 4 interleaved pairs, said with the interval whichever way it falls.
    assert re.search(
        r"^matched: the same .* \(median of 4 interleaved pairs; the pairs run from \S+x to \S+x", text, re.M
    )
    # Issue 41: each of the four contests names a winner only beyond both runs' spreads and the margin.
    assert verdict_checker.check(text).count("contest") == 4, text
    # DeepSpeed at its defaults leaves tiny unsharded; at threshold 0 it gathers what FSDP2 without resharding does.
    assert "so at its defaults DeepSpeed shards none of them" in text
    assert "the same bytes, both keeping the gathered weights from forward to backward" in text


def test_08_crossover_scale_and_the_production_surface(executed):
    """Issue 33: the critical tokens at scale are budget's, the measured crossover lies within 25% of the closed form
    at the machine's rate there, the useful ranks are budget's, and accumulated FSDP2 reduce-scatters once."""
    from labkit.engines import fsdp2
    from labkit.engines.base import RunConfig
    from labkit.model import build_model

    text = _text(executed("08_lab_to_real_run.ipynb"))
    at_scale = budget.critical_tokens(
        30e9, 256, tokens_per_rank=16384, link_gbytes=50, peak_tflops=989, mfu=0.4
    )
    assert f"computed {at_scale['critical_tokens_per_rank']:.0f} tokens" in text, text
    crossover = re.search(
        r"^crossover: measured ([\d,]+) tokens per rank .* closed form ([\d,]+) at R = \S+ GFLOP/s \(down to "
        r"([\d,]+) with 03's floor, \d+% of the bytes, on the link alone\): ratio (\S+)$",
        text,
        re.M,
    )
    assert crossover, text
    measured, closed, low = (int(crossover.group(i).replace(",", "")) for i in (1, 2, 3))
    assert float(crossover.group(4)) == pytest.approx(measured / closed, abs=0.006)
    # the issue's acceptance, within 25% of the closed form: of its band, T* x (1 - f) (03's floor on the link
    # alone) to T*
    assert 0.75 * low <= measured <= 1.25 * closed, text
    assert sorted(verdict_checker.check(text)) == ["crossover", "rate"], text  # issue 41: verdicts hold
    useful = budget.largest_useful_world_size(30e9, 4e6, link_gbytes=50, peak_tflops=989, mfu=0.4)
    assert f"computed {useful['world_size']} ranks" in text
    assert re.search(r"^off .* no$", text, re.M) and re.search(
        r"^on .* yes$", text, re.M
    )  # checkpointing fits
    cfg = RunConfig(world_size=2, steps=3)
    once = fsdp2.predicted_wire_bytes(build_model("tiny"), cfg, 2)["reduce_scatter"]
    assert "Formula one step's reduce-scatter bytes, once" in text and "equal to the byte" in text
    rows = re.findall(r"^([01])\s+(False|True)\s+[\d,]+\s+([\d,]+)\s+([\d,]+)$", text, re.M)
    fsdp2_rows = [(m, sync, int(rs.replace(",", ""))) for m, sync, rs, _ in rows[:2]]
    assert fsdp2_rows == [("0", "False", 0), ("1", "True", once)], rows
    ds = re.findall(r"^([01])\s+(False|True)\s+[\d,]+\s+([\d,]+)$", text, re.M)
    assert [int(rs.replace(",", "")) for _, _, rs in ds] == [once, once], ds  # DeepSpeed: every micro-step
    assert "two process groups" in text and "weights equal to the usual build to 0" in text


def test_03_beside_a_normal_priority_neighbour_completes_and_every_verdict_holds_or_says_it_cannot(tmp_path):
    """Issue 41: a classmate's busy kernel at the same priority beside the lab (the suite's other notebook runs have
    two at nice 19): 03 completes under papermill, and each timing verdict holds against its printed figures
    or says this machine was too busy to resolve it."""
    import papermill as pm

    from labkit.neighbours import busy_neighbours

    out = tmp_path / "03.ipynb"
    with busy_neighbours(1, nice=0):
        pm.execute_notebook(
            str(NOTEBOOKS / "03_prefetch_overlap.ipynb"),
            str(out),
            kernel_name=KERNEL_NAME,
            cwd=str(NOTEBOOKS),
            progress_bar=False,
            execution_timeout=420,
        )
    text = _text(nbformat.read(out, as_version=4))
    assert sorted(verdict_checker.check(text)) == ["busy", "drawn", "drawn", "floor", "prefetch"], text


def test_deterministic_budget_cells_reproduce_under_nbval(executed, tmp_path):
    """nbval --nbval-lax re-runs each notebook's `nbval-check-output` cells (and its parameters) in a fresh
    kernel and compares their outputs with the papermill run's: the budget cells are deterministic."""
    checked = []
    for name in ALL:
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        if not any(CHECK_TAG in c.metadata.get("tags", []) for c in committed.cells):
            continue
        nb = executed(name)
        keep = [
            c
            for c in nb.cells
            if c.cell_type == "code"
            and {"parameters", "injected-parameters", CHECK_TAG} & set(c.metadata.get("tags", []))
        ]
        if not any(CHECK_TAG in c.metadata.get("tags", []) for c in keep):
            continue
        sub = nbformat.v4.new_notebook(cells=keep, metadata=nb.metadata)
        path = tmp_path / name
        nbformat.write(sub, path)
        checked.append(path)
    assert checked, "no notebook has nbval-check-output cells"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", *map(str, checked)],
        cwd=NOTEBOOKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_04_on_a_node_without_libaio_prints_the_refusal_and_goes_on(monkeypatch, capsys):
    """The NVMe cell with DeepSpeed's async_io op unavailable (a hub image without libaio): one sentence, no
    run, no exception, so papermill carries on with the rest of 04."""
    from labkit import prebuild
    from labkit.engines import loop
    from labkit.engines.base import RunConfig

    nb = nbformat.read(ROOT / "notebooks" / "04_offload.ipynb", as_version=4)
    [cell] = [c for c in nb.cells if "refuse_nvme_without_async_io" in c.source]
    monkeypatch.setattr(
        prebuild, "op_status", lambda name, ext_dir=None: prebuild.OpStatus(name, "skipped", "", "", [])
    )
    monkeypatch.setattr(
        loop, "run_many", lambda *a, **k: pytest.fail("the NVMe run started without async_io")
    )
    exec(cell.source, {"RunConfig": RunConfig, "world_size": 2})
    said = capsys.readouterr().out.splitlines()[-1]  # after DeepSpeed's own line on importing
    assert said.startswith(
        "ZeRO-Infinity is not run on this node: offload='nvme' needs DeepSpeed's async_io op, "
        "and libaio is not installed"
    ), said
