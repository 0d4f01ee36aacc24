#!/usr/bin/env bash
# Everything this project checks on a GPU machine, in one run (one GPU, NCCL; the machine's own torch, no network).
# Parts (GPU_CHECK_PARTS, space-separated; default: all, about eight minutes on an H200), each with its own time limit
# so that one that hangs spoils no other, each writing a log and a JSON file to $OUT (or ./gpu-check):
#   tests        the GPU-marked tests (a capture off the step's stream, the pinned arena, NCCL jobs resumed bitwise...)
#   capture      what a snapshot's capture of 1 GB blocks: in the step (the old way) against a side stream
#                (capture_blocking.py)
#   throughput   the FSDP2 GPT with every feature on, every feature off, and the plain FSDP2 script, interleaved,
#                THROUGHPUT_REPEATS rounds (default 3; per-round ratios, median and range)
#   fingerprint  what a replica fingerprint costs against a step (fingerprint_cost.py)
#   regroup      what in-process recovery saves a worker on NCCL (regroup_nccl.py)
#   syncprobe    (not in the default) every call site where a worker's host waits for the GPU in a short FSDP2 job
#                (ELASTIC_RUNNER_CUDA_SYNC_DEBUG=warn)
#   bash benchmarks/gpu_check.sh                                        # from the repository root
#   GPU_CHECK_PARTS="tests capture throughput" THROUGHPUT_REPEATS=2 bash benchmarks/gpu_check.sh   # a short window
#   GPU_TESTS="tests/unit/test_staging.py" ...                         # only these GPU tests
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-check}")
parts=" ${GPU_CHECK_PARTS:-tests capture throughput fingerprint regroup} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
want() { [[ "$parts" == *" $1 "* ]]; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" \
    | tee "$out/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
if want tests; then
    # shellcheck disable=SC2086  # GPU_TESTS: a list of test files or ids, split on spaces
    timeout "${GPU_TESTS_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -rA -m gpu ${GPU_TESTS:-tests/unit/test_staging.py \
        tests/unit/test_snapshot_writer_process.py tests/elastic/test_gpu_paths.py tests/unit/test_zygote.py \
        tests/multiprocess/test_optional_paths.py tests/unit/test_stragglers.py tests/unit/test_health.py} 2>&1 \
        | tee "$out/tests.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
fi
if want capture; then
    (cd benchmarks && timeout 60 python3 capture_blocking.py --gigabytes 1 --rounds 5 --out "$out/capture_blocking.json" \
        > "$out/capture_blocking.log" 2>&1; tail -25 "$out/capture_blocking.log")
fi
if want throughput; then
    (cd benchmarks && timeout "${THROUGHPUT_TIMEOUT:-330}" python3 throughput.py --gpu --workloads gpt --gpt-size 12,12,768 \
        --variants elastic-runner-fsdp,elastic-runner-fsdp-bare,baseline-fsdp --repeats "${THROUGHPUT_REPEATS:-3}" \
        --steps 120 --skip 30 --out "$out/throughput.json" > "$out/throughput.log" 2>&1; grep -E "^gpt |Error" "$out/throughput.log"
     python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workloads']['gpt']; print(json.dumps({k: w[k] for k in ('medians', 'ratios', 'fsdp_snapshot_blocking_ms')}))" "$out/throughput.json")
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
if want fingerprint; then
    timeout 40 python3 benchmarks/fingerprint_cost.py --device cuda --repeats 10 --out "$out/fingerprint_cost.json" \
        > "$out/fingerprint_cost.log" 2>&1; grep -E "^mlp" "$out/fingerprint_cost.log"
fi
if want regroup; then
    timeout 100 python3 benchmarks/regroup_nccl.py --repeats 3 --out "$out/regroup_nccl.json" > "$out/regroup_nccl.log" 2>&1
    tail -5 "$out/regroup_nccl.log"
fi
