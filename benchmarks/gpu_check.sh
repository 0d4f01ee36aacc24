#!/usr/bin/env bash
# Everything this project checks on a GPU machine (one GPU, NCCL; the machine's own torch, no network).
# Parts (GPU_CHECK_PARTS, space-separated; default "tests capture throughput": about nine and a half minutes on an H200
# by the 2026-11-28 runs, a throughput run ~32 s — one call of the device tool; "jobs fingerprint regroup" is a second,
# about five), each with its own time limit so that one that hangs spoils no other, each writing a log and a JSON file
# to $OUT (or ./gpu-check):
#   tests        the quick GPU-marked tests (a capture off the step's stream, the pinned arena, the zygote, the
#                stragglers' clock, the health check)
#   jobs         the GPU-marked jobs (an FSDP2 and a compiled model recovering bitwise on NCCL; about three minutes)
#   capture      what a snapshot's capture of 1 GB blocks: in the step (the old way) against a side stream
#                (capture_blocking.py)
#   throughput   the GPT under FSDP2 with every feature on, every feature off, the plain FSDP2 script, and under DDP
#                with every feature on and the plain DDP script, interleaved, THROUGHPUT_REPEATS rounds (default 3;
#                per-round ratios, median and range); `python3 benchmarks/gpu_table.py $OUT` makes the docs' tables
#   fingerprint  what a replica fingerprint costs against a step (fingerprint_cost.py)
#   regroup      what in-process recovery saves a worker on NCCL (regroup_nccl.py)
#   syncprobe    (not in the default) every call site where a worker's host waits for the GPU in a short FSDP2 job
#                (ELASTIC_RUNNER_CUDA_SYNC_DEBUG=warn)
#   bash benchmarks/gpu_check.sh                                        # from the repository root
#   GPU_CHECK_PARTS="jobs fingerprint regroup" bash benchmarks/gpu_check.sh          # the second call
#   THROUGHPUT_REPEATS=2 THROUGHPUT_VARIANTS=elastic-runner-fsdp,elastic-runner-fsdp-bare bash benchmarks/gpu_check.sh
#   GPU_TESTS="tests/unit/test_staging.py" ...                         # only these GPU tests
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-check}")
parts=" ${GPU_CHECK_PARTS:-tests capture throughput} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
want() { [[ "$parts" == *" $1 "* ]]; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" \
    | tee "$out/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
if want tests; then
    # shellcheck disable=SC2086  # GPU_TESTS: a list of test files or ids, split on spaces
    timeout "${GPU_TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rA -m gpu ${GPU_TESTS:-tests/unit/test_staging.py \
        tests/unit/test_snapshot_writer_process.py tests/unit/test_zygote.py tests/unit/test_stragglers.py \
        tests/unit/test_health.py} 2>&1 | tee "$out/tests.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
fi
if want capture; then
    (cd benchmarks && timeout 60 python3 capture_blocking.py --gigabytes 1 --rounds 5 --out "$out/capture_blocking.json" \
        > "$out/capture_blocking.log" 2>&1; tail -25 "$out/capture_blocking.log")
fi
if want throughput; then
    (cd benchmarks && timeout "${THROUGHPUT_TIMEOUT:-540}" python3 throughput.py --gpu --workloads gpt --gpt-size 12,12,768 \
        --variants "${THROUGHPUT_VARIANTS:-elastic-runner-fsdp,elastic-runner-fsdp-bare,baseline-fsdp,elastic-runner,baseline}" \
        --repeats "${THROUGHPUT_REPEATS:-3}" --steps 100 --skip 25 --out "$out/throughput.json" > "$out/throughput.log" 2>&1; grep -E "^gpt |Error" "$out/throughput.log"
     python3 gpu_table.py "$out")
fi
if want syncprobe; then
    # Every call site where a worker's host waits for the GPU, once each (torch's sync debug mode): start-up, resume
    # and logging steps wait by design; a line from the step itself is a finding.
    (cd benchmarks && ELASTIC_RUNNER_CUDA_SYNC_DEBUG=warn timeout 60 python3 throughput.py --gpu --workloads gpt \
        --gpt-size 12,12,768 --variants elastic-runner-fsdp --repeats 1 --steps 60 --skip 10 --workdir /tmp/syncprobe \
        > /dev/null 2>&1)
    grep -rh -A1 "synchronizing CUDA operation" /tmp/syncprobe 2>/dev/null | grep -v "^--$" | sort | uniq -c \
        | sort -rn > "$out/sync_probe.txt"
    head -40 "$out/sync_probe.txt"
fi
if want jobs; then
    timeout 270 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/elastic/test_gpu_paths.py \
        tests/multiprocess/test_optional_paths.py 2>&1 | tee "$out/jobs.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
fi
if want fingerprint; then
    timeout 40 python3 benchmarks/fingerprint_cost.py --device cuda --repeats 10 --out "$out/fingerprint_cost.json" \
        > "$out/fingerprint_cost.log" 2>&1; grep -E "^mlp" "$out/fingerprint_cost.log"
fi
if want regroup; then
    PYTHONUNBUFFERED=1 timeout 160 python3 benchmarks/regroup_nccl.py --repeats 3 --out "$out/regroup_nccl.json" \
        > "$out/regroup_nccl.log" 2>&1
    grep -vE "Warning|warn" "$out/regroup_nccl.log" | tail -12
fi
