"""Execute a submission's working copy with papermill: `python -m labkit.grading.runner NOTEBOOK EXECUTED RESULT`.

This runs as the grader's child (see `sandbox.run`), never in the grader itself. Every cell runs even when
one raises (an unanswered cell raises NotImplementedError; that is a wrong answer, not a broken run), the
executed notebook is saved after each cell as evidence, and RESULT gets a small JSON account of the run:
whether it reached the end, which cells raised, and, if the kernel died, how and in which cell. It holds
no score. Exit status 0: the notebook ran to the end; 3: the kernel died; 4: papermill could not run it.

The kernel is named explicitly, `KERNEL_NAME` ("python3"): ipykernel's own kernel, which jupyter_client starts
with this interpreter, so grading needs no registered `labkit` kernel (the one the committed notebooks name)
and runs the labkit it was installed with, whatever kernelspec the student's notebook names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat

KERNEL_NAME = "python3"
KERNEL_START_TIMEOUT_S = 60
DEAD_KERNEL, CANNOT_RUN = 3, 4
_kernel_processes: list = []  # the Popen of each kernel started here, to read its exit status after it dies


def _watched_kernel_manager() -> type:
    """jupyter_client's AsyncKernelManager, keeping the kernel's process object when it starts."""
    from jupyter_client.manager import AsyncKernelManager

    class WatchedKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw):
            await super().start_kernel(**kw)
            _kernel_processes.append(getattr(self.provisioner, "process", None))

    return WatchedKernelManager


def _kernel_exit() -> str:
    process = next((p for p in reversed(_kernel_processes) if p is not None), None)
    code = process.poll() if process is not None else None
    if code is None:
        return "the kernel died"
    if code < 0:
        from labkit.grading.sandbox import signal_name

        return f"the kernel was killed by {signal_name(-code)}"
    return f"the kernel exited with status {code}"


def last_started_cell(executed: Path) -> str | None:
    """Id of the last cell papermill started in the executed notebook (the one running when it stopped)."""
    try:
        nb = nbformat.read(executed, as_version=4)
    except Exception:  # noqa: BLE001 (a notebook cut short mid-write has no usable record)
        return None
    started = [c for c in nb.cells if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    return started[-1].get("id") if started else None


def raised_cells(executed: Path) -> list[dict]:
    """[{"id", "error"}] for every cell of the executed notebook with an error output."""
    nb = nbformat.read(executed, as_version=4)
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                out.append(
                    {"id": cell.get("id"), "error": f"{output.get('ename')}: {output.get('evalue')}"[:200]}
                )
                break
    return out


def run(notebook: Path, executed: Path) -> tuple[int, dict]:
    """Execute `notebook` (in its own folder) into `executed`; (exit status, result dict)."""
    import papermill
    from nbclient.exceptions import DeadKernelError

    result = {"completed": False, "reason": "", "raised": []}
    try:
        papermill.execute_notebook(
            str(notebook),
            str(executed),
            kernel_name=KERNEL_NAME,
            cwd=str(notebook.parent),
            allow_errors=True,
            progress_bar=False,
            start_timeout=KERNEL_START_TIMEOUT_S,
            kernel_manager_class=_watched_kernel_manager(),
        )
    except papermill.PapermillExecutionError:
        pass  # some cells raised; allow_errors ran the rest, and they are listed below
    except DeadKernelError:
        cell = last_started_cell(executed)
        result["reason"] = f"{_kernel_exit()} while running cell {cell!r}" if cell else _kernel_exit()
        return DEAD_KERNEL, result
    except Exception as e:  # noqa: BLE001 (papermill's own failures: a bad notebook, a kernel that never started)
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        result["reason"] = f"papermill could not run the notebook: {why}"
        return CANNOT_RUN, result
    result["completed"] = True
    result["raised"] = raised_cells(executed)
    return 0, result


def main(argv: list[str]) -> int:
    notebook, executed, result_path = (Path(a) for a in argv)
    status, result = run(notebook, executed)
    result_path.write_text(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
