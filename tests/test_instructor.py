"""For instructors: the guide's commands run as written, Binder agrees with the pins, `labkit doctor --class`
gives verdicts computed here from this machine's cores and memory, and every notebook has its cheat sheet.

The guide (docs/instructor.md) marks the commands that need no hub with a `sh test` fence; they are run here,
in a scratch folder holding `submissions/alice.ipynb` and `submissions/bob.ipynb` (two solved exercises), and
every `labkit ...` line of any block is parsed by the real CLI.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import nbformat
import pytest
import yaml
from packaging.version import Version

from labkit import budget, classroom, doctor, release, slides
from labkit.cli import build_parser, main
from labkit.limits import read_limits
from labkit.model import build_model, count_params
from labkit.placement import RANK_BYTES_ESTIMATE, RANKS_PER_CORE

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "instructor.md"
RESULTS = ROOT / "benchmarks" / "results.md"  # `make bench` writes it; the guide quotes its course timings
COURSE_SECTION = "## The course, end to end"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>[^\s;#]+)$")
SUBMISSIONS = {"alice.ipynb": "01_memory.ipynb", "bob.ipynb": "06_hsdp.ipynb"}  # cheap ones (seconds each)
RELEASE = "labkit-student"  # the student release's folder and repository in the guide


def fenced_blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block, indented ones (in list items) included."""
    blocks, info, lines = [], None, []
    for raw in markdown.splitlines():
        line = raw.strip()
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
            else:
                blocks.append((info, lines))
                info = None
        elif info is not None:
            lines.append(line)
    assert info is None, "an unclosed code block"
    return blocks


def guide_commands(tested_only: bool) -> list[str]:
    found = []
    for info, lines in fenced_blocks(GUIDE.read_text()):
        if tested_only and info != "sh test":
            continue
        found += [ln for ln in lines if ln.startswith("labkit ")]
    return found


# ------------------------------------------------------------------------------------------------ the guide


def test_every_labkit_line_of_the_guide_parses():
    lines = guide_commands(tested_only=False)
    assert len(lines) >= 6, lines
    for line in lines:
        build_parser().parse_args(shlex.split(line)[1:])  # a drifted flag raises UsageError here
    tested = guide_commands(tested_only=True)
    assert {shlex.split(ln)[1] for ln in tested} == {"doctor", "grade", "slides", "release"}, tested
    for info, lines in fenced_blocks(GUIDE.read_text()):
        if info == "sh test":
            assert all(ln.startswith("labkit ") for ln in lines), f"a tested block runs labkit only: {lines}"


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every `sh test` command of the guide, in order, each in its own process, in one scratch folder."""
    work = tmp_path_factory.mktemp("guide")
    (work / "submissions").mkdir()
    for name, solution in SUBMISSIONS.items():
        shutil.copy(ROOT / "solutions" / solution, work / "submissions" / name)
    runs = {}
    for line in guide_commands(tested_only=True):
        argv = shlex.split(line)
        runs[line] = subprocess.run(
            [sys.executable, "-m", "labkit", *argv[1:]], cwd=work, capture_output=True, text=True, timeout=600
        )
    return work, runs


def test_guide_commands_run_as_written(guide_run):
    _, runs = guide_run
    for line, out in runs.items():
        assert "Traceback" not in out.stderr, f"{line}: {out.stderr[-2000:]}"
        # The doctor exits 1 when it reports a problem (an answer, not a failure); nothing else may fail.
        allowed = (0, 1) if line.startswith("labkit doctor") else (0,)
        assert out.returncode in allowed, f"{line} -> {out.returncode}: {out.stderr[-2000:]}"
    doctor_out = runs["labkit doctor"].stdout
    assert "smoke test" in doctor_out and "all_reduce on 2 ranks" in doctor_out
    [class_line] = [ln for ln in runs if "--class" in ln]
    students = int(shlex.split(class_line)[-1])
    assert f"class of {students}:" in runs[class_line].stdout
    assert all(nb in runs[class_line].stdout for nb in NOTEBOOKS)


def test_guide_grades_a_folder_and_regrades_one(guide_run):
    work, runs = guide_run
    [folder_line] = [ln for ln in runs if ln.startswith("labkit grade") and "--gradebook" in ln]
    gradebook = work / shlex.split(folder_line)[shlex.split(folder_line).index("--gradebook") + 1]
    rows = {r["file"]: r for r in csv.DictReader(gradebook.open())}
    assert set(rows) == set(SUBMISSIONS)
    for row in rows.values():
        assert row["status"] == "graded" and row["score"] == row["max"], row  # solutions score full marks
    reports = work / f"{gradebook.stem}-reports"
    for name in SUBMISSIONS:
        stem = name.removesuffix(".ipynb")
        assert (reports / f"{stem}.report.json").is_file() and (reports / f"{stem}.executed.ipynb").is_file()
    [one_line] = [ln for ln in runs if ln.startswith("labkit grade") and "--out" in ln]
    argv = shlex.split(one_line)
    report = json.loads((work / argv[argv.index("--out") + 1]).read_text())
    assert report["status"] == "graded" and report["score"] == report["max_score"] > 0
    assert "locked cells unchanged" in runs[one_line].stdout  # it prints each check


def test_guide_builds_slides_and_cheat_sheets(guide_run):
    work, runs = guide_run
    [line] = [ln for ln in runs if ln.startswith("labkit slides")]
    argv = shlex.split(line)
    out = work / argv[argv.index("--out") + 1]
    index = (out / "index.html").read_text()
    for stem in NOTEBOOKS:
        assert (out / f"{stem}.slides.html").is_file()
        sheet = (out / f"{stem}.cheatsheet.md").read_text()
        assert slides.FIGURE_SLOT not in sheet and "<!-- figure:" not in sheet
        assert "this build has no outputs" in sheet  # built from the committed, output-free notebooks
        assert (out / f"{stem}.cheatsheet.html").read_text().startswith("<!DOCTYPE html>")
        assert f'href="{stem}.cheatsheet.html"' in index
    assert f"{len(NOTEBOOKS)} decks, {len(NOTEBOOKS)} cheat sheets" in runs[line].stdout


def _table(markdown: str, header_start: str) -> list[list[str]]:
    lines = markdown.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([cell.strip() for cell in ln.strip("|").split("|")])
    return rows


def test_resource_table_is_the_notebooks_own_figures():
    rows = _table(GUIDE.read_text(), "| notebook | ranks |")
    needs = {n.notebook: n for n in classroom.notebook_needs()}
    assert [r[0] for r in rows] == NOTEBOOKS == list(needs)
    for name, ranks, gpus, memory, _run_time in rows:
        assert int(ranks) == int(gpus) == needs[name].ranks, name
        assert memory == f"{needs[name].memory_bytes / 1e9:.1f} GB", name


def benchmark_course_seconds(markdown: str) -> tuple[str, dict[str, int]]:
    """(the run's "DATE on MACHINE", {name: seconds}) from benchmarks/results.md: its title (DATE: the course
    section's own when it was re-measured alone) and the lines `- NAME: N s` of its "The course, end to end"
    section (notebooks, grading; the total as "total")."""
    title = re.match(r"# Benchmarks \((\d{4}-\d\d-\d\d), (.+)\)$", markdown.splitlines()[0])
    assert title, f"{RESULTS.name} does not start with '# Benchmarks (DATE, MACHINE)'"
    lines = markdown.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(COURSE_SECTION)]
    if not starts:
        pytest.fail(
            f"{RESULTS} has no {COURSE_SECTION!r} section: regenerate it with `make bench` "
            "(without --quick or --no-course), then quote its figures in the guide",
            pytrace=False,
        )
    seconds = {}
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        if m := re.fullmatch(r"- (.+): (\d+) s", line):
            seconds[m[1]] = int(m[2])
        elif m := re.match(r"- total (\d+) s", line):
            seconds["total"] = int(m[1])
    remeasured = re.search(
        r"^Re-measured alone \(`run_all.py --course-only`\) on (\d{4}-\d\d-\d\d);", markdown, re.M
    )
    return f"{remeasured[1] if remeasured else title[1]} on {title[2]}", seconds


def test_guide_quotes_the_course_timings_of_benchmarks_results():
    run, seconds = benchmark_course_seconds(RESULTS.read_text())
    guide = GUIDE.read_text()
    assert f"run of {run}:" in guide, f"the guide names the run it quotes: 'run of {run}:'"
    measured = {name.removesuffix(".ipynb"): s for name, s in seconds.items() if name.endswith(".ipynb")}
    assert list(measured) == NOTEBOOKS, f"{RESULTS.name} times {list(measured)}, the course is {NOTEBOOKS}"
    quoted = {}
    for name, *_, run_time in _table(guide, "| notebook | ranks |"):
        m = re.fullmatch(r"(\d+) s", run_time)
        assert m, f"{name}: run time {run_time!r} is not 'N s'"
        quoted[name] = int(m[1])
    assert quoted == measured, f"the guide's run times differ from {RESULTS.name}: update the guide's table"
    m = re.search(
        r"Grading all the solutions \(`labkit grade solutions/ --gradebook grades.csv`\) took (\d+) s, and the whole\s+"
        r"course, grading included, (\d+) s",
        guide,
    )
    assert m, "the guide quotes the grading time and the total"
    assert (int(m[1]), int(m[2])) == (seconds["grading all solutions"], seconds["total"]), (
        f"the guide's grading time and total differ from {RESULTS.name}"
    )


def test_benchmark_course_seconds_reads_the_section_it_names():
    text = (
        "# Benchmarks (2031-01-02, aarch64, 8 threads, torch 9.9, CPU gloo)\n\n## Step time\n\n- a.ipynb: 1 s\n\n"
        f"{COURSE_SECTION} (papermill)\n\n- 00_x.ipynb: 7 s\n- 01_y.ipynb: 123 s\n"
        "- grading all solutions: 40 s\n- total 170 s (target < 600 s)\n\n## Against the targets\n\n"
        "- course 170 s (target < 600 s): met\n"
    )
    assert benchmark_course_seconds(text) == (
        "2031-01-02 on aarch64, 8 threads, torch 9.9, CPU gloo",
        {"00_x.ipynb": 7, "01_y.ipynb": 123, "grading all solutions": 40, "total": 170},
    )
    with pytest.raises(pytest.fail.Exception, match="make bench"):
        benchmark_course_seconds(text.replace(COURSE_SECTION, "## Something else"))


def test_workshop_order_names_every_notebook_and_exercise():
    rows = _table(GUIDE.read_text(), "| notebook | then |")
    assert [r[0][:2] for r in rows] == [n[:2] for n in NOTEBOOKS]
    named = re.findall(r"\bex(\d\d)\b", " ".join(r[1] for r in rows))
    exercises = sorted(p.name[:2] for p in (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(named) == exercises, "each exercise follows one notebook"


def test_nbgitpuller_link_opens_a_real_notebook():
    [link] = re.findall(r"https://HUB/\S+", GUIDE.read_text())
    url = urlparse(link)
    assert url.path == "/hub/user-redirect/git-pull"
    query = parse_qs(url.query)
    assert set(query) == {"repo", "branch", "urlpath"}
    assert query["repo"][0] == f"https://github.com/OWNER/{RELEASE}"  # the student release's repository
    urlpath = query["urlpath"][0]  # decoded: lab/tree/<clone folder>/<path>?autodecode
    assert urlpath.startswith(f"lab/tree/{RELEASE}/") and urlpath.endswith("?autodecode"), urlpath
    inside = urlpath.removeprefix(f"lab/tree/{RELEASE}/").removesuffix("?autodecode")
    assert (ROOT / inside).is_file() and inside.split("/")[0] in release.COURSE_FILES, inside


def test_guide_writes_the_student_release_its_link_pulls(guide_run):
    work, runs = guide_run
    [line] = [ln for ln in runs if ln.startswith("labkit release")]
    folder = work / shlex.split(line)[-1]
    assert folder.name == RELEASE and "student release:" in runs[line].stdout
    assert (folder / "notebooks" / "00_start_here.ipynb").is_file() and (folder / "exercises").is_dir()
    assert not (folder / "solutions").exists() and not list(
        (folder / "labkit" / "grading" / "checks").glob("ex*.py")
    )


# ------------------------------------------------------------------------------------------------ Binder


def _pins(lines: list[str]) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = PIN.match(line.split("#", 1)[0].strip())
        if m:
            pins[m["name"].lower().replace("_", "-")] = m["version"]
    return pins


def _pip_section(path: Path) -> list[str]:
    deps = yaml.safe_load(path.read_text())["dependencies"]
    return next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)


def _python_spec(path: Path) -> str:
    deps = yaml.safe_load(path.read_text())["dependencies"]
    return next(d for d in deps if isinstance(d, str) and d.startswith("python"))


def _test_only(path: Path) -> set[str]:
    [line] = [ln for ln in path.read_text().splitlines() if ln.startswith("# test-only:")]
    return set(line.split(":", 1)[1].split())


def test_environment_binder_and_requirements_agree_on_every_shared_pin():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    top = _pins(_pip_section(ROOT / "environment.yml"))
    binder_yml = ROOT / "binder" / "environment.yml"
    binder = _pins(_pip_section(binder_yml))
    for name in set(req) & set(top):
        assert top[name] == req[name], (
            f"environment.yml pins {name}=={top[name]}, requirements.txt {req[name]}"
        )
    torch = Version(binder.pop("torch"))
    assert (torch.public, torch.local) == (req["torch"], "cpu"), (
        f"binder's torch is the CPU build of {req['torch']}"
    )
    for name, version in binder.items():
        assert req.get(name) == version, f"binder pins {name}=={version}, requirements.txt {req.get(name)}"
        if name in top:
            assert top[name] == version
    left_out = _test_only(binder_yml)
    assert not left_out & set(binder), "a pin is both carried and declared test-only"
    missing = set(req) - set(binder) - {"torch"} - left_out
    assert not missing, f"binder/environment.yml lacks {sorted(missing)}: add them, or list them as test-only"
    assert _python_spec(binder_yml) == _python_spec(ROOT / "environment.yml") == "python=3.11"


def test_binder_takes_torch_from_the_cpu_index_and_labkit_in_postbuild():
    pip = _pip_section(ROOT / "binder" / "environment.yml")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in pip
    assert pip.index("--extra-index-url https://download.pytorch.org/whl/cpu") < next(
        i for i, ln in enumerate(pip) if ln.startswith("torch==")
    )
    assert not [ln for ln in pip if ln.startswith("-e")], (
        "labkit is installed by postBuild, after the repo is copied"
    )
    deps = yaml.safe_load((ROOT / "binder" / "environment.yml").read_text())["dependencies"]
    assert "pip" in deps, "micromamba (repo2docker's solver) needs pip listed before a pip section"


def test_binder_postbuild_installs_labkit_prebuilds_and_registers_the_kernel():
    post = ROOT / "binder" / "postBuild"
    assert post.stat().st_mode & stat.S_IXUSR, "postBuild is executable"
    lines = [ln.strip() for ln in post.read_text().splitlines()]
    assert lines[0] == "#!/bin/bash"
    assert any(ln.startswith("set -e") for ln in lines), "repo2docker does not stop on errors without set -e"
    text = post.read_text()
    order = [
        "pip install --no-deps -e .",
        "-m labkit.prebuild",
        f"ipykernel install --sys-prefix --name {doctor.KERNEL_NAME} ",
    ]
    at = [text.index(s) for s in order]
    assert at == sorted(at), "labkit, then its ops, then the kernel"
    assert f"--sys-prefix --name {doctor.KERNEL_NAME} " in (ROOT / "Makefile").read_text(), "one kernel name"


def test_binder_folder_is_all_repo2docker_reads():
    folder = ROOT / "binder"
    assert not (folder / "Dockerfile").exists(), "a Dockerfile would make repo2docker ignore everything else"
    assert (folder / "environment.yml").is_file()
    for line in (folder / "apt.txt").read_text().splitlines():
        package = line.split("#", 1)[0].strip()
        assert not package or re.fullmatch(r"[a-z0-9.+-]+", package), f"repo2docker rejects {package!r}"


def test_readme_links_binder_and_the_guide():
    readme = (ROOT / "README.md").read_text()
    assert "docs/instructor.md" in readme
    binder = r"https://mybinder\.org/v2/gh/[^/\s]+/[^/\s]+/[^?\s]+\?urlpath=lab/tree/([^)\s]+)"
    [path] = re.findall(binder, readme)
    assert (ROOT / path).is_file(), path


# ------------------------------------------------------------------------------------------------ doctor --class


def _expected_need(path: Path) -> tuple[int, int]:
    """(ranks, memory bytes) of one notebook, worked out here from its cells with regular expressions."""
    nb = nbformat.read(path, as_version=4)
    [params] = [c.source for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    ranks = max(int(v) for v in re.findall(r"^\w*world_size\s*=\s*(\d+)", params, re.M))
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    models = set(re.findall(r"\bmodel\s*=\s*[\"'](\w+)[\"']", code))
    state = max(
        (
            budget.plan(count_params(build_model(m)), 1, "ddp", precision="fp32")["state_bytes_per_rank"]
            for m in models
        ),
        default=0,
    )
    return ranks, (ranks + 1) * RANK_BYTES_ESTIMATE + ranks * state


@pytest.mark.parametrize("students", [1, 40])
def test_doctor_class_verdicts_follow_this_machine(students, capsys):
    status = main(["doctor", "--skip-smoke", "--class", str(students), "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    klass = report["class"]
    limits = (
        read_limits()
    )  # the container's limits where there are any (a CI runner's cgroup), else the host's
    cores = limits.cpus.value
    node = klass["node"]
    assert node["cpu_cores"] == cores and node["ranks_per_core"] == RANKS_PER_CORE
    now = limits.memory.value
    assert abs(node["memory_bytes"] - now) < 0.25 * now, "the node's memory is what is available now"
    memory = node["memory_bytes"]  # read moments apart on a shared machine: judge with the report's own
    slots = math.floor(RANKS_PER_CORE * cores + 1e-9)
    each = klass["per_student"]
    assert each["ranks"] == max(
        0, min(slots // students, int((memory / students - RANK_BYTES_ESTIMATE) // RANK_BYTES_ESTIMATE))
    )
    rows = {r["notebook"]: r for r in klass["notebooks"]}
    assert list(rows) == NOTEBOOKS
    for name, row in rows.items():
        ranks, need = _expected_need(ROOT / "notebooks" / f"{name}.ipynb")
        assert (row["ranks"], row["memory_bytes"]) == (ranks, need), name
        fits = ranks * students <= slots and need * students <= memory
        assert row["fits"] == fits, (name, row)
        most = min(slots // ranks, memory // need)  # on GPUs or CPU ranks, each rank takes a slot
        assert row["device"] == ("cuda" if node["gpus"] // students >= ranks else "cpu"), name
        assert row["max_students"] == most, name
    assert klass["fits"] == all(r["fits"] for r in rows.values())
    advice = klass["advice"]
    if klass["fits"]:
        assert len(advice) == 1 and advice[0].startswith(
            f"{students} student(s) fit: each may use {each['ranks']} ranks"
        )
        assert advice[0] not in report["problems"]
    else:
        short = [n for n, r in rows.items() if not r["fits"]]
        assert [line.split(" ", 1)[0] for line in advice] == short, "one line per notebook that does not fit"
        for line in advice:
            assert line in report["problems"]
            assert (
                f"at most {rows[line.split(' ', 1)[0]]['max_students']} at once" in line or "even one" in line
            )
    assert status == (0 if report["ok"] else 1)


def test_class_report_on_a_node_with_gpus():
    needs = classroom.notebook_needs()
    node = {"cpu_cores": 32, "memory_bytes": 256 * 10**9, "gpus": 8}
    two = classroom.class_report(2, needs, node)  # 4 GPUs each: every notebook on NCCL
    assert {r["device"] for r in two["notebooks"]} == {"cuda"} and two["fits"]
    four = classroom.class_report(4, needs, node)  # 2 GPUs each: the 3- and 4-rank notebooks fall back to CPU
    for row in four["notebooks"]:
        assert row["device"] == ("cuda" if row["ranks"] <= 2 else "cpu"), row
    big = max(needs, key=lambda n: n.memory_bytes)
    crowd = math.floor(node["memory_bytes"] / big.memory_bytes) + 1  # one student more than memory allows
    report = classroom.class_report(crowd, needs, node)
    [row] = [r for r in report["notebooks"] if r["notebook"] == big.notebook]
    assert not row["fits_memory"] and not row["fits"]


# Made-up notebooks for the worked examples below. RANK_BYTES_ESTIMATE is 500 MiB = 524,288,000 B; the
# memory is (ranks + 1 kernel) x 524,288,000 + ranks x state, worked out by hand: tiny has 489,024 parameters
# (embeddings 18,432 + 4,608, four blocks of 111,840, final norm 192, head 18,432), 16 B each for an fp32
# AdamW replica = 7,824,384 B per rank.
FOUR = classroom.NotebookNeed("four", 4, (), 0, 2_621_440_000)  # 5 x 524,288,000
TWO = classroom.NotebookNeed("two", 2, ("tiny",), 7_824_384, 1_588_512_768)  # 3 x 524,288,000 + 2 x 7,824,384
EIGHT = classroom.NotebookNeed("eight", 8, (), 0, 4_718_592_000)  # 9 x 524,288,000


def _verdicts(report: dict) -> dict[str, tuple[str, bool, bool, int]]:
    return {
        r["notebook"]: (r["device"], r["fits_cores"], r["fits_memory"], r["max_students"])
        for r in report["notebooks"]
    }


def test_class_of_5_on_a_cpu_node_worked_by_hand():
    assert RANK_BYTES_ESTIMATE == 524_288_000 and RANKS_PER_CORE == 4  # the figures the answers use
    node = {"cpu_cores": 8, "memory_bytes": 16_000_000_000, "gpus": 0}
    report = classroom.class_report(5, [FOUR, TWO, EIGHT], node)
    # 32 CPU ranks // 5 = 6; 16 GB / 5 = 3.2 GB holds the kernel's 524,288,000 B and 5 more ranks (6.10 - 1).
    assert report["per_student"] == {"cpu_cores": 1.6, "memory_bytes": 3_200_000_000, "gpus": 0, "ranks": 5}
    assert _verdicts(report) == {
        "four": ("cpu", True, True, 6),  # 20 of 32 ranks, 13.1 of 16 GB; 7 x 2.62 GB > 16 GB
        "two": ("cpu", True, True, 10),  # 10 of 32 ranks, 7.9 of 16 GB; 11 x 1.59 GB > 16 GB
        "eight": ("cpu", False, False, 3),  # 40 ranks > 32, 23.6 GB > 16; 4 x 4.7 GB > 16 GB
    }
    assert [r["fits"] for r in report["notebooks"]] == [True, True, False] and not report["fits"]
    assert report["advice"] == [
        "eight needs 8 ranks and 4.7 GB per student; 5 students need 40 ranks on 8 cores (4 per core) and "
        "23.6 GB of 16.0 GB available: at most 3 at once here: stagger it, pair students on one server, or "
        "spread the class over 2 such nodes"
    ]
    assert classroom.format_class(report).splitlines()[0] == (
        "class of 5: this node has 8 cpu cores, 16.0 GB available, 0 gpus; each student gets 1.6 cores, "
        "3.2 GB, 0 gpus, 5 ranks"
    )


def test_class_of_2_on_a_gpu_node_worked_by_hand():
    node = {"cpu_cores": 16, "memory_bytes": 64_000_000_000, "gpus": 4}
    report = classroom.class_report(2, [FOUR, TWO, EIGHT], node)
    # 64 CPU ranks // 2 = 32; 32 GB each holds 60 ranks beside the kernel (61.04 - 1); 4 GPUs // 2 = 2 each.
    assert report["per_student"] == {"cpu_cores": 8, "memory_bytes": 32_000_000_000, "gpus": 2, "ranks": 32}
    assert _verdicts(report) == {
        "four": ("cpu", True, True, 16),  # 2 GPUs < 4 ranks: CPU ranks; 64 // 4 = 16 < 64 GB // 2.62 GB = 24
        "two": ("cuda", True, True, 32),  # a GPU per rank; 64 // 2 = 32 < 64 GB // 1.59 GB = 40
        "eight": ("cpu", True, True, 8),  # 64 // 8 = 8 < 64 GB // 4.72 GB = 13
    }
    assert report["fits"]
    assert report["advice"] == [
        "2 student(s) fit: each may use 32 ranks (8 cores, 32.0 GB); the largest default is 8 ranks (eight)"
    ]
    # A third student leaves each 1 GPU: the 2-rank notebook moves to CPU ranks and still fits (3 <= 32).
    three = classroom.class_report(3, [FOUR, TWO, EIGHT], node)
    assert _verdicts(three)["two"] == ("cpu", True, True, 32) and three["fits"]


def test_notebook_need_of_a_made_up_notebook_worked_by_hand(tmp_path):
    params = nbformat.v4.new_code_cell('world_size = 2\nhpz_world_size = 3\nmodel = "tiny"\nsteps = 2 * 5\n')
    params.metadata["tags"] = ["parameters"]
    cells = [
        nbformat.v4.new_markdown_cell('model="small" in prose is not a model the notebook trains'),
        params,
        nbformat.v4.new_code_cell("%time x = 1"),  # a magic: not Python, skipped
        nbformat.v4.new_code_cell('run(world_size=world_size, model="tiny_deep")\nplot(model="no_such")'),
    ]
    path = tmp_path / "09_made_up.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    # The largest *world_size is 3; tiny_deep (16 blocks of 111,840: 1,831,104 parameters x 16 B) is the larger
    # replica: 29,297,664 B; memory 4 x 524,288,000 + 3 x 29,297,664.
    assert classroom.notebook_need(path) == classroom.NotebookNeed(
        "09_made_up", 3, ("tiny", "tiny_deep"), 29_297_664, 2_185_044_992
    )


def test_doctor_class_prints_the_verdicts_of_its_node(monkeypatch, capsys):
    monkeypatch.setattr(
        classroom, "node_capacity", lambda: {"cpu_cores": 8, "memory_bytes": 16 * 10**9, "gpus": 0}
    )
    monkeypatch.setattr(classroom, "notebook_needs", lambda notebooks_dir=None: [FOUR, TWO, EIGHT])
    status = main(["doctor", "--skip-smoke", "--class", "5", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert _verdicts(report["class"])["eight"] == ("cpu", False, False, 3)
    [line] = [p for p in report["problems"] if p.startswith("eight needs")]
    assert line.endswith(
        "at most 3 at once here: stagger it, pair students on one server, or spread the class "
        "over 2 such nodes"
    )
    assert status == 1


def test_doctor_class_0_is_a_usage_error(capsys):
    assert main(["doctor", "--skip-smoke", "--class", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--class" in err[0]


# ------------------------------------------------------------------------------------------------ cheat sheets


def test_every_notebook_has_a_one_page_cheat_sheet():
    sheets = ROOT / "docs" / "cheatsheets"
    for stem in NOTEBOOKS:
        source = (sheets / f"{stem}.md").read_text()
        assert slides.FIGURE_SPEC.match(source), f"{stem}.md starts with <!-- figure: REGEX -->"
        re.compile(slides.FIGURE_SPEC.match(source)["pattern"])
        assert source.count(slides.FIGURE_SLOT) == 1
        for part in ("**Key formula.**", "**The figure to remember.**", "**Common mistake.**"):
            assert part in source, f"{stem}.md has no {part}"
        assert re.search(rf"^# {stem[:2]} · ", source, re.M), f"{stem}.md's title names notebook {stem[:2]}"
        assert len(source.split()) < 450, f"{stem}.md is longer than one printed page"


def test_cheat_sheet_quotes_the_line_an_executed_notebook_printed(tmp_path):
    name = "03_prefetch_overlap"
    source = (ROOT / "docs" / "cheatsheets" / f"{name}.md").read_text()
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    printed = (
        "scratch, prefetch on: step 72.1 ms (IQR 70.2 to 75.0 over 6) (the slowest rank's); "
        "rank 0 blocked on collectives 20.3 ms (IQR 18.9 to 22.0 over 6) per step"
    )
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"scratch, prefetch off: ...\n{printed}\n")
    ]
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / f"{name}.ipynb")
    slides.build(tmp_path / "out", tmp_path / "nbs", log=lambda *_: None)
    sheet = (tmp_path / "out" / f"{name}.cheatsheet.md").read_text()
    assert f"`{printed}` (this run's output)" in sheet
    assert printed in (tmp_path / "out" / f"{name}.cheatsheet.html").read_text()
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="something else\n")]
    assert "not found in this run's output" in slides.cheatsheet_markdown(source, nb)
