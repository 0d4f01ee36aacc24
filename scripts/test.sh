#!/usr/bin/env bash
# Set up and run the tests on both torch releases the project supports:
#   1. the whole suite on torch 2.14.1 + torchvision 0.29.1 (.venv-vision; extra arguments go to this pytest run),
#   2. a shorter run on torch 2.13.0, the CPU wheel the quickstart uses (.venv): the unit tests that touch torch's
#      own APIs (the torch-patch canaries, the torchrun hook, rendezvous handlers and store, snapshot loading, the
#      snapshot writer process, components, the sampler), the launcher and regroup tests, and five elastic scenarios:
#      a worker SIGKILL resumed from a survivor's memory, and in-process recovery of a worker kill, a rank-0 kill, a node
#      lost and joining, and a lost node on etcd-v3 (the 2.13 path recreates the group). The other tests check our
#      own logic; the first run covers them.
# The tests install what they need from Debian themselves (etcd-server, prometheus) when run as root.
set -uo pipefail
cd "$(dirname "$0")/.."
# The two venvs take ~7 GB and the suite writes ~1.5 GB more (tmp directories, torch's compile cache): a run that
# fails with "No space left on device" needs more than this.
echo "==> free disk space here: $(df -h --output=avail . | tail -1 | tr -d ' ')"
scripts/setup.sh vision-test || exit 1
.venv-vision/bin/python -m pytest -ra --durations=50 "$@"
full=$?
scripts/setup.sh test || exit 1
echo "==> the short run on torch 2.13.0"
.venv/bin/python -m pytest -ra -p no:cacheprovider \
  tests/unit/test_torch_patches.py tests/unit/test_torchrun_hook.py tests/unit/test_fast_rendezvous.py \
  tests/unit/test_lease_rendezvous.py tests/unit/test_etcd_fake.py tests/unit/test_snapshot.py \
  tests/unit/test_snapshot_writer_process.py \
  tests/unit/test_security.py tests/unit/test_components.py tests/unit/test_image_data.py tests/unit/test_sampler.py \
  tests/unit/test_preflight.py tests/unit/test_master_port.py tests/multiprocess/test_launch.py tests/unit/test_compile.py \
  tests/multiprocess/test_regroup.py tests/unit/test_worker_context.py tests/unit/test_warm_spare.py tests/unit/test_handover.py \
  "tests/elastic/test_in_process.py::test_a_killed_worker_is_replaced_alone_its_peer_keeps_its_process_and_the_run_ends_bitwise_identical[torchrun]" \
  "tests/elastic/test_in_process.py::test_a_node_lost_and_a_node_joining_leave_the_survivors_worker_in_its_process[elastic-runner]" \
  tests/elastic/test_in_process.py::test_with_rank_0s_worker_killed_a_new_round_keeps_the_other_nodes_worker_and_the_run_ends_bitwise_identical \
  tests/unit/test_round_members.py "tests/elastic/test_in_process_etcd.py::test_a_node_that_is_lost_or_leaves_does_not_hold_the_next_round_for_its_lease[lost]" \
  "tests/elastic/test_fast_recovery.py::test_worker_kill_resumes_from_a_survivors_memory_losing_no_step_and_ends_bitwise_identical"
short=$?
echo "==> torch 2.14.1 + torchvision 0.29.1: pytest exit $full; torch 2.13.0: pytest exit $short"
[ "$full" -eq 0 ] && [ "$short" -eq 0 ]
