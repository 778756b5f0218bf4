#!/usr/bin/env bash
# Downloads, here, the wheels gpu_check.sh installs on the device machine, which reaches no
# package registry and whose image lacks them: Liger-Kernel (pure Python, Triton kernels;
# its dependencies, torch and triton, are in the image). They go to benchmarks/wheels/,
# which git ignores; name that folder in the device tool's `carry`:
#
#   bash benchmarks/gpu_wheels.sh
#   run(command="bash benchmarks/gpu_check.sh", carry=["benchmarks/wheels"], timeout_s=600)
#
# apex is left out: its normalization kernels are a CUDA extension that must be compiled
# there (minutes of the 15 the device time allows), so its column says "not installed".
set -euo pipefail
cd "$(dirname "$0")" || exit 1
python=${PYTHON:-python3}
LIGER=${LIGER_VERSION:-0.8.5}  # the release read for the bench's builders (bench/ops.py)
mkdir -p wheels
"$python" -m pip download --no-deps --disable-pip-version-check --quiet \
    --dest wheels "liger-kernel==$LIGER"
ls -l wheels
