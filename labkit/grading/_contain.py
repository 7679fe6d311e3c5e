"""Exec wrapper: `python -I -S _contain.py SPEC -- CMD...` joins cgroups, sets rlimits, then becomes CMD.

Run by `labkit.grading.sandbox` between fork and the untrusted command, so that every process the
command ever starts inherits the limits (no preexec_fn: the grader has threads). Standard library only,
and no site packages (-S), so it costs a few milliseconds. Exit status 125: a limit could not be applied,
and the command did not run.
"""

import json
import os
import resource
import sys

_RLIMITS = {
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "core": resource.RLIMIT_CORE,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    cmd = sys.argv[3:]
    try:
        for procs in spec.get("cgroups", []):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for name, value in spec.get("rlimits", {}).items():
            resource.setrlimit(_RLIMITS[name], (int(value), int(value)))
    except (OSError, ValueError, KeyError) as e:
        print(f"labkit grade: could not contain the submission ({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(125)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
