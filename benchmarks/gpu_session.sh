#!/usr/bin/env bash
# Issue 31's GPU checks as two prepared calls on a lent GPU machine (the device tool: 15 minutes a session, the
# machine's start included, 10 a command): the carried wheels installed, then
#   PART=smoke (default)  DeepSpeed's CUDA ops built, then benchmarks/gpu_smoke.py (NOTEBOOKS=1 adds 00-08
#                         under papermill, minutes more)                              run's timeout_s: 590
#   PART=bench            benchmarks/gpu.py's MFU table and one profiled step per engine at world size 1
#                         (the Perfetto traces in one tar: at most 8 files come back)  run's timeout_s: 400
# Every report goes under $OUT. Commit benchmarks/results-gpu.md (the MFU table) and the smoke's report.
#   here, once:  mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#                HEADLESS=1 SKIP="numpy matplotlib ..." ../shared/tools/offline-wheels.sh .whl 3.12
#                (SKIP: what the machine's image already holds, ../.library/device/KINDS.md; about 25 MB is left)
#   there:       bash benchmarks/gpu_session.sh   (carry [".whl"])
set -uo pipefail
out=${OUT:-artifacts/gpu}
part=${PART:-smoke}
py=${PY:-python3}  # the machine's Python with its own torch
wheels=${WHEELS:-.whl}  # the carried wheels' folder
case $part in smoke | bench) ;; *) echo "gpu_session.sh: PART=$part; pass smoke or bench" >&2; exit 2 ;; esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl ||
    { echo "gpu_session.sh: the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$py" -c 'import torch; print(torch.__version__, torch.version.cuda)'; } >"$out/machine.txt" 2>&1
if [ "$part" = smoke ]; then
  (time "$py" -m labkit.prebuild) >"$out/prebuild.log" 2>&1
  skip_notebooks=--skip-notebooks
  [ -n "${NOTEBOOKS:-}" ] && skip_notebooks=
  # the budget stops new checks in time for the report to be written; the timeout only guards a hang
  timeout 540 "$py" benchmarks/gpu_smoke.py --skip-prebuild --skip-benchmark $skip_notebooks --budget-s 330 \
    --out "$out/smoke.md" >"$out/smoke.log" 2>&1
  echo "gpu_smoke.py exit status $?" >>"$out/smoke.log"
else
  timeout 240 "$py" benchmarks/gpu.py --out "$out/results-gpu.md" >"$out/gpu.log" 2>&1
  echo "gpu.py exit status $?" >>"$out/gpu.log"
  timeout 130 "$py" benchmarks/profile_step.py --world-size 1 --out /tmp/traces >"$out/profile.log" 2>&1
  echo "profile_step.py exit status $?" >>"$out/profile.log"
  tar -czf "$out/traces.tgz" -C /tmp traces
fi
ls -la "$out"
