#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI (CPU only) cannot run. By hand, on a host with one GPU and the
# project's Python packages installed, from anywhere:
#
#     bash scripts/gpu_checks.sh [OUT_DIR]        # ~4 min on one H200; a log per step in OUT_DIR
#
#   tests   pytest -m gpu: tests/test_outer_buffers.py, tests/test_zero.py, tests/test_gpu.py (the two-GPU cases
#           skip on one GPU; their gloo paths are tested in CI)
#   outer   bench/outer_step.py at 150m, H 50 on the GPU: none, int8, int8 with overlap (R1 goal <= 0.05)
#   inner   bench/inner_loop.py at 150m, seq 1024, bf16: the engine's step against a plain loop, and MFU
#   issue 45 (at most 470 s of step limits, under 8 min on one H100; alone: ZB_GPU_STEPS="mfu_1b_eager
#           mfu_1b_compiled memory_150m memory_1b parity_1b" bash scripts/gpu_checks.sh):
#   mfu_1b_eager, mfu_1b_compiled   bench/inner_loop.py at 1b, bf16, seq 1024, the engine loop alone at the largest
#           micro-batch the memory estimate fits (--micro-batch auto), eager and compiled: tokens/s, MFU against the
#           card's named dense bf16 peak, peak memory (goal MFU >= 45 %)
#   memory_150m, memory_1b   bench/memory_check.py: the estimate against torch.cuda.max_memory_allocated for single,
#           fsdp, zero1/2/3 on one GPU (goal: within 15 %)
#   parity_1b   bench/inner_loop.py at 1b: the engine against a plain loop, compiled, 3 rounds (goal: median >= 0.98)
#
# Each step has its own time limit; a failed step does not stop the next; the exit status is 1 if any failed.
# ZB_GPU_DEADLINE=SECONDS skips the steps that would start after that many seconds (a lease with a hard end).
# ZB_GPU_STEPS="NAME ..." runs only the steps named (the first command, the environment's line, always runs).
set -u
cd "$(dirname "$0")/.."
out=${1:-/tmp/zb-gpu-checks}
mkdir -p "$out"
py=${PYTHON:-python3}
deadline=${ZB_GPU_DEADLINE:-100000}
export PYTHONUNBUFFERED=1
# every engine a test starts is its own interpreter, as users run it: the tests' fork server (tests/forkserver.py)
# would fork them from one process whose imports may have touched the CUDA driver, which a forked child cannot use
export ZEROBAND_TEST_FORK=0
failed=()

step() {  # step NAME SECONDS COMMAND...: COMMAND under a time limit, its output in OUT/NAME.log
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    if [[ -n "${ZB_GPU_STEPS:-}" && " $ZB_GPU_STEPS " != *" $name "* ]]; then return; fi
    if (( SECONDS + 20 > deadline )); then
        echo "== $name: skipped (ZB_GPU_DEADLINE)"; failed+=("$name"); return
    fi
    (( SECONDS + limit > deadline )) && limit=$(( deadline - SECONDS ))
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: rc $rc in $(( SECONDS - t0 )) s (limit $limit s)"
    tail -n "${TAIL:-12}" "$out/$name.log"
    (( rc == 0 )) || failed+=("$name")
}

{ nvidia-smi -L; $py -c 'import torch, deepspeed, pydantic, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("deepspeed", deepspeed.__version__, "pydantic", pydantic.VERSION, "transformers", transformers.__version__)'
} 2>&1 | tee "$out/env.log"

# DeepSpeedCPUAdam (ZeRO offload) is JIT-built once per machine: build it beside the first tests, not inside one
build=
wants() { [[ -z "${ZB_GPU_STEPS:-}" || " $ZB_GPU_STEPS " == *" $1 "* ]]; }
wants tests && timeout -k 5 240 $py -c 'import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
DeepSpeedCPUAdam([torch.zeros(4, requires_grad=True)])
print("DeepSpeedCPUAdam built")' >"$out/cpu_adam.log" 2>&1 &
wants tests && build=$!

# test_zero last: its offload case waits on the build's lock if the build is not done
# the tests share the one GPU (each needs well under 1 GiB) on pytest-xdist workers where it is installed
workers=()
$py -c 'import xdist' 2>/dev/null && workers=(-n "${ZB_GPU_WORKERS:-4}")
step tests "${ZB_GPU_TESTS_S:-330}" $py -m pytest -p no:cacheprovider -q -rfEs "${workers[@]}" -m gpu tests/test_outer_buffers.py \
    tests/test_gpu.py tests/test_zero.py
if [[ -n "$build" ]]; then wait $build; echo "== cpu_adam build: $(tail -n 1 "$out/cpu_adam.log")"; fi

outer=(bench/outer_step.py --device cuda --preset 150m --inner-steps 50 --rounds 2)
step outer_none 60 $py "${outer[@]}" --compression none
step outer_int8 60 $py "${outer[@]}" --compression int8
step outer_int8_overlap 60 $py "${outer[@]}" --compression int8 --overlap
step inner "${ZB_GPU_INNER_S:-90}" $py bench/inner_loop.py --preset 150m --seq-len 1024 --micro-batch 8 --steps 20 \
    --rounds 3 --nproc 0 --precision bf16-mixed --device cuda

# issue 45: MFU at 1b, the memory estimate against the measured peak, the engine against a plain loop at 1b
one_b=(bench/inner_loop.py --preset 1b --seq-len 1024 --precision bf16-mixed --device cuda --nproc 0)
step mfu_1b_eager 60 $py "${one_b[@]}" --loops engine --micro-batch auto --steps 10 --rounds 1
step mfu_1b_compiled "${ZB_GPU_COMPILE_S:-140}" $py "${one_b[@]}" --loops engine --micro-batch auto --steps 10 --rounds 1 \
    --compile
memory=(bench/memory_check.py --device cuda --precision bf16-mixed --seq-len 1024 --steps 3)
step memory_150m 60 $py "${memory[@]}" --preset 150m --micro-batch 8
step memory_1b 100 $py "${memory[@]}" --preset 1b --micro-batch 4
step parity_1b "${ZB_GPU_PARITY_S:-110}" $py "${one_b[@]}" --micro-batch auto --steps 5 --rounds 3 --compile

if (( ${#failed[@]} )); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all GPU checks passed"
