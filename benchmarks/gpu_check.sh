#!/usr/bin/env bash
# Everything this project checks on a GPU machine, in one run of about eight minutes (one GPU, NCCL; the machine's
# own torch, no network): the GPU-marked tests, then the FSDP2 throughput against the plain FSDP2 script with bf16
# compute, with and without snapshots, node memory and watchdog. Results go to $OUT (or ./gpu-check) as a log and a
# JSON file each.
#   bash benchmarks/gpu_check.sh            # from the repository root
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" \
    | tee "$out/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
timeout 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/unit/test_zygote.py tests/elastic/test_gpu_paths.py \
    tests/multiprocess/test_optional_paths.py tests/unit/test_snapshot_writer_process.py 2>&1 | tee "$out/tests.log" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
cd benchmarks && timeout 270 python3 throughput.py --gpu --workloads gpt --gpt-size 12,12,768 \
    --variants elastic-runner-fsdp,baseline-fsdp,elastic-runner-fsdp-bare --repeats 2 --steps 200 --skip 40 \
    --out "$OLDPWD/$out/throughput.json" 2>&1 | tee "$OLDPWD/$out/throughput.log" | grep -E "^gpt "
