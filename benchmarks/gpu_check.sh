#!/usr/bin/env bash
# Everything this project checks on a GPU machine, in one run of at most nine minutes (six on an H200) (one GPU, NCCL; the machine's
# own torch, no network): the GPU-marked tests; what a replica fingerprint costs against a step (fingerprint_cost.py);
# what in-process recovery saves a worker on NCCL (regroup_nccl.py:
# a new process against a survivor rebuilding its group, compiled and not); then the FSDP2 throughput against the
# plain FSDP2 script with bf16 compute, with and without snapshots, node memory and watchdog. Results go to $OUT (or
# ./gpu-check) as a log and a JSON file each; each part has its own time limit, so one that hangs spoils no other.
#   bash benchmarks/gpu_check.sh            # from the repository root
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-check}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" \
    | tee "$out/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
timeout 270 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/unit/test_zygote.py tests/elastic/test_gpu_paths.py \
    tests/multiprocess/test_optional_paths.py tests/unit/test_snapshot_writer_process.py tests/unit/test_stragglers.py tests/unit/test_health.py 2>&1 | tee "$out/tests.log" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
timeout 40 python3 benchmarks/fingerprint_cost.py --device cuda --repeats 10 --out "$out/fingerprint_cost.json" 2>&1 \
    | tee "$out/fingerprint_cost.log"
timeout 100 python3 benchmarks/regroup_nccl.py --repeats 3 --out "$out/regroup_nccl.json" 2>&1 | tee "$out/regroup_nccl.log"
cd benchmarks && timeout 170 python3 throughput.py --gpu --workloads gpt --gpt-size 12,12,768 \
    --variants elastic-runner-fsdp,baseline-fsdp,elastic-runner-fsdp-bare --repeats 1 --steps 150 --skip 30 \
    --out "$out/throughput.json" 2>&1 | tee "$out/throughput.log" | grep -E "^gpt "
