"""recovery.regroup: which way the survivors rebuild their process group on this torch build and backend."""

from __future__ import annotations

import pytest

from elastic_runner.worker.regroup import RegroupError, chosen_regroup, regroup_method


def test_auto_reconfigures_where_this_build_can_and_recreates_elsewhere() -> None:
    assert chosen_regroup("auto", "gloo") == regroup_method("gloo")[0]
    assert chosen_regroup("auto", "nccl") == "recreate", "only gloo has been run through reconfigure"
    assert chosen_regroup("recreate", "gloo") == "recreate", "recreate works everywhere"


def test_reconfigure_asked_for_where_it_is_not_possible_says_why_and_what_to_use() -> None:
    with pytest.raises(RegroupError, match=r"recovery\.regroup: reconfigure is not possible here: .*(only used on "
                                           r"gloo so far|no process-group reconfigure API).*Use auto .* or recreate"):
        chosen_regroup("reconfigure", "nccl")
    possible, why = regroup_method("gloo")
    if possible == "reconfigure":
        assert chosen_regroup("reconfigure", "gloo") == "reconfigure"
    else:  # torch 2.13.0
        with pytest.raises(RegroupError, match="has no process-group reconfigure API"):
            chosen_regroup("reconfigure", "gloo")
