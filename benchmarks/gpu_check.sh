#!/usr/bin/env bash
# Issue 6's GPU half in one run: the Triton kernels' tests compiled on CUDA, then the
# standard-shape bench on the GPU (torch eager beside normkit, Liger-Kernel and apex when
# installed). Writes everything under $OUT (default ./gpu-out), eight files, the most the
# device tool brings back:
#   tests.log        pytest tests/test_triton.py tests/test_triton_dispatch.py
#                    tests/test_accelerator_policy.py (no device sync under "auto")
#   steps.log        torch, triton, CUDA and the device; the wheel installs; then the
#                    output of both bench runs, and the LayerNorm/RMSNorm widths timed as
#                    CUDA graph replays (normkit bench --cuda-graphs: kernels, no host)
#   overhead.txt     benchmarks/gpu_overhead.py: host us per call, kernel time under CUDA
#                    graphs, a sweep of the two untuned launch parameters, a direct-launch
#                    experiment, a profile, torch's CUDA accuracy at offsets and its
#                    16-bit second derivatives beside normkit's; then
#                    benchmarks/gpu_step.py: whole training steps (MLP, conv, LSTM)
#   results-gpu.json, RESULTS-gpu.md   the table for benchmarks/RESULTS.md
#   results-gpu-widths.json, RESULTS-gpu-widths.md   LayerNorm/RMSNorm and their add ops
#                    at 4096 rows of width 256 to 16384 (issue 6: fwd+bwd >= torch eager
#                    at every width; fwd >= 80% of HBM peak from 1024)
#   targets-gpu.md   issue 6 GPU targets over both runs (normkit bench --summarize), then
#                    those of normkit's Triton BatchNorm/GroupNorm on channels-last
#                    (--backend triton, eager and CUDA graphs; their tables in steps.log)
#
# The device machine reaches no package registry, and its image has no Liger-Kernel: the
# wheels in benchmarks/wheels/ (ignored by git; `bash benchmarks/gpu_wheels.sh` downloads
# them here) are installed first, without dependencies, so name that folder in the device
# tool's `carry` (GPU_WHEELS=DIR reads another folder). Without them the bench's Liger
# column says "not installed".
#
# Needs a python3 with a CUDA build of torch, triton, pytest, hypothesis and numpy (the
# device machine's image has them); normkit runs from src/ without installing. Each
# step has its own time limit (a bench stopped by it still writes the passes it measured,
# marked interrupted) and the tests, last, get what is left of 570 s, so the whole run
# ends inside the device tool's timeout_s=600; on the H200 of 2026-11-30 it took about 3
# minutes, on 2026-12-04 the
# steps before the tests ~2.5 and the tests more than their 160 s then (H200 HBM3e peak,
# for the % of peak: 4.8 TB/s; steps.log has nvidia-smi's clocks and memory):
#   bash benchmarks/gpu_check.sh            (on the GPU machine, from the repo root)
#
# GPU_CHECK_DRY=1 rehearses the same steps on the CPU with small shapes and one repeat,
# the GPU tests skipped (CI runs them through the interpreter): it checks this script,
# the bench's options and the summary on any machine, so that the one GPU run is not
# lost to a typo (tests/test_bench.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on CUDA tensors, not the interpreter
python=${PYTHON:-python3}
failed=""  # the steps that did not exit 0; the script's exit status says whether any
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then  # (no CUDA graphs on the CPU: eager timings)
    device=cpu shapes=small repeats=1 widths=64x256,64x1024 flush=1 graphs=""
else  # (flush: an H200's 60 MB L2 would otherwise hold rows up to 4096 x 1024, in and out)
    device=cuda shapes=standard repeats=9 flush=256 graphs=--cuda-graphs
    widths=4096x256,4096x512,4096x1024,4096x2048,4096x4096,4096x8192,4096x16384
fi

steps="$out/steps.log" part=$(mktemp)  # (each step's output, then appended to steps.log)
"$python" - > "$steps" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
EOF
nvidia-smi --query-gpu=name,driver_version,clocks.max.memory,clocks.max.sm,memory.total \
    --format=csv >> "$steps" 2>&1
cat "$steps"


shopt -s nullglob
wheels=("${GPU_WHEELS:-benchmarks/wheels}"/*.whl)
shopt -u nullglob
echo "== wheels: ${wheels[*]:-none in ${GPU_WHEELS:-benchmarks/wheels}}" >> "$steps"
if [ ${#wheels[@]} -gt 0 ]; then
    if [ "$device" = cuda ]; then  # (the device tool runs commands as root, in its own image)
        "$python" -m pip install --no-index --no-deps --disable-pip-version-check \
            "${wheels[@]}" >> "$steps" 2>&1
    else  # a dry run installs them aside, to check they install, and leaves them out
        "$python" -m pip install --no-index --no-deps --disable-pip-version-check \
            --target "$out/.wheels" "${wheels[@]}" >> "$steps" 2>&1
    fi
    code=$?; echo "wheels: exit $code (${#wheels[@]} installed)"
    [ "$code" = 0 ] || failed="$failed wheels"
    rm -rf "$out/.wheels"
else
    echo "wheels: none (benchmarks/gpu_wheels.sh downloads them)"
fi

# every op but the eval-mode ones (added after this script's time budget was set; on
# CUDA they run torch's own kernels under backend="auto")
timeout -k 15 80 "$python" -m normkit bench layer_norm rms_norm batch_norm group_norm \
    instance_norm layer_norm2d add_layer_norm add_rms_norm batch_norm_act \
    batch_norm_act_inplace group_norm_act --device "$device" --shapes "$shapes" \
    --repeats "$repeats" --flush-mib "$flush" --quiet --peak-gbs 4800 \
    --json "$out/results-gpu.json" --markdown "$out/RESULTS-gpu.md" > "$part" 2>&1
code=$?; echo "bench: exit $code (tail of $steps)"
[ "$code" = 0 ] || failed="$failed bench"
{ echo "== bench: exit $code"; cat "$part"; } >> "$steps"
tail -n 5 "$part"

timeout -k 15 70 "$python" -m normkit bench layer_norm rms_norm add_layer_norm add_rms_norm \
    --device "$device" --shapes "$widths" --repeats "$repeats" --flush-mib "$flush" \
    --quiet --peak-gbs 4800 \
    --json "$out/results-gpu-widths.json" \
    --markdown "$out/RESULTS-gpu-widths.md" > "$part" 2>&1
code=$?; echo "sweep: exit $code (tail of $steps)"
[ "$code" = 0 ] || failed="$failed sweep"
{ echo "== sweep: exit $code"; cat "$part"; } >> "$steps"
tail -n 5 "$part"
# the same widths timed as CUDA graph replays: the kernels without the host, which is
# how issue 6's "% of HBM peak" can be judged at widths whose kernels take less time
# than any eager call's host work (into steps.log: the device tool brings back 8 files)
timeout -k 15 60 "$python" -m normkit bench layer_norm rms_norm \
    --device "$device" --shapes "$widths" --repeats "$repeats" --flush-mib "$flush" \
    --quiet --peak-gbs 4800 $graphs --markdown "$part" > "$part.log" 2>&1
code=$?; echo "graphs: exit $code (tail of $steps)"
[ "$code" = 0 ] || failed="$failed graphs"
# (on failure its own output, traceback included, not a stale table: on 2026-12-04 a
# crash before the table was written left only the sweep's table in $part)
if [ "$code" = 0 ]; then shown="$part"; else shown="$part.log"; fi
{ echo "== graphs: exit $code"; cat "$shown"; } >> "$steps"
tail -n 12 "$shown"
rm -f "$part" "$part.log"

# normkit's Triton BatchNorm and GroupNorm on channels-last input, which "auto" leaves to
# torch's kernels on CUDA (`normkit bench --backend triton`): issue 6's "GN/BN
# channels_last >= 1.5x" for these kernels, eager and, on the GPU, as CUDA graph replays;
# the tables into steps.log, the targets' verdicts after the main ones in targets-gpu.md
if [ "$device" = cuda ]; then tshapes=32x64x56x56:cl,32x256x14x14:cl tenv=""
else tshapes=2x8x3x3:cl tenv=TRITON_INTERPRET=1; fi  # (the dry run: the interpreter)
triton_runs=()
for mode in eager $graphs; do
    json=$(mktemp --suffix .json)
    timeout -k 15 90 env $tenv "$python" -m normkit bench batch_norm group_norm \
        --backend triton --device "$device" --shapes "$tshapes" --repeats "$repeats" \
        --flush-mib "$flush" --quiet --peak-gbs 4800 \
        $([ "$mode" = eager ] || echo --cuda-graphs) --json "$json" --markdown "$part" \
        > "$part.log" 2>&1
    code=$?; echo "triton $mode: exit $code (tail of $steps)"
    if [ "$code" = 0 ]; then shown="$part" triton_runs+=("$mode:$json")
    else shown="$part.log" failed="$failed triton-$mode"; fi
    { echo "== triton channels-last, $mode: exit $code"; cat "$shown"; } >> "$steps"
    tail -n 6 "$shown"
done
rm -f "$part" "$part.log"

if [ "$device" = cuda ]; then
    timeout -k 15 120 "$python" benchmarks/gpu_overhead.py > "$out/overhead.txt" 2>&1
else  # (the interpreter is slow: rehearse the first step only)
    TRITON_INTERPRET=1 NORMKIT_OVERHEAD_DEVICE=cpu "$python" benchmarks/gpu_overhead.py \
        precision double_backward direct_launch opt_in > "$out/overhead.txt" 2>&1
fi
code=$?; echo "overhead: exit $code ($out/overhead.txt)"
[ "$code" = 0 ] || failed="$failed overhead"

# whole training steps (MLP, conv and LSTM stacks), appended to overhead.txt
echo "== benchmarks/gpu_step.py" >> "$out/overhead.txt"
if [ "$device" = cuda ]; then
    timeout -k 15 50 "$python" benchmarks/gpu_step.py >> "$out/overhead.txt" 2>&1
else
    NORMKIT_STEP_DEVICE=cpu "$python" benchmarks/gpu_step.py >> "$out/overhead.txt" 2>&1
fi
code=$?; echo "steps: exit $code ($out/overhead.txt)"
[ "$code" = 0 ] || failed="$failed steps"

"$python" -m normkit bench --summarize "$out/results-gpu.json" "$out/results-gpu-widths.json" \
    > "$out/targets-gpu.md" 2>&1
code=$?; echo "targets: exit $code ($out/targets-gpu.md)"
[ "$code" = 0 ] || failed="$failed targets"
for run in "${triton_runs[@]}"; do  # (each timing apart: pooled, the eager rows decide)
    { echo; echo "## normkit bench --backend triton (${run%%:*}): channels-last BN, GN"; echo
      "$python" -m normkit bench --summarize "${run#*:}"; } >> "$out/targets-gpu.md" 2>&1
    rm -f "${run#*:}"
done
cat "$out/targets-gpu.md"
# the tests last: on the H200 of 2026-12-04 every other step took ~150 s together, and
# the tests' Triton compiles take the rest (the fuzz tests compile a variant per drawn
# configuration: 5 examples each here, 15 in CI through the interpreter, which compiles
# nothing); verbose, so a stopped run still names each result
# (they get what is left of 570 s since the start, at most 210: the whole run then ends
# inside the device tool's 600 s however long the steps above took)
limit=$(( 570 - SECONDS < 210 ? 570 - SECONDS : 210 ))
if [ "$device" = cuda ] && [ "$limit" -lt 30 ]; then
    echo "skipped: ${limit} s left of the run's 570 s, too few for the tests" > "$out/tests.log"
    echo "tests: skipped (time)"
    failed="$failed tests"
elif [ "$device" = cuda ]; then
    # (pytest-xdist, in the device image, spreads the kernels' compiles over 16 processes)
    par=$("$python" -c 'import xdist' 2>/dev/null && echo "-n 16")
    NORMKIT_TRITON_FUZZ_EXAMPLES=${NORMKIT_TRITON_FUZZ_EXAMPLES:-5} \
    timeout -k 15 "$limit" "$python" -m pytest -v -rf -p no:cacheprovider $par --durations=15 \
        tests/test_triton.py tests/test_triton_dispatch.py tests/test_accelerator_policy.py \
        tests/test_bench.py::test_cuda_graph_timing_replays_every_implementation \
        > "$out/tests.log" 2>&1
    code=$?; echo "tests: exit $code (tail of $out/tests.log)"
    [ "$code" = 0 ] || failed="$failed tests"
else
    echo "skipped: GPU_CHECK_DRY=1 (the Triton tests run in CI through the interpreter)" \
        > "$out/tests.log"
    echo "tests: skipped (dry run)"
fi
tail -n 5 "$out/tests.log"

if [ -n "$failed" ]; then
    echo "failed steps:$failed"
    exit 1
fi
