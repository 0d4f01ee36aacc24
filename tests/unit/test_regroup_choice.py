"""recovery.regroup: which way the survivors rebuild their process group on this torch build and backend."""

from __future__ import annotations

import pytest

from elastic_runner.recovery.rebuild import ReconfigureRefused, RegroupError, chosen_regroup, regroup_method


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


class _RefusingMembers:
    """Members whose backend will not create a reconfigurable group (what the method decides is left in it)."""

    class _Group:
        method = "reconfigure"

    def __init__(self) -> None:
        self.regroup = self._Group()

    def first(self, wait: object, leaving: object = None) -> float:
        raise ReconfigureRefused("the gloo group of torch 9.9 does not support reconfigure")


def test_a_backend_that_refuses_a_reconfigurable_group_falls_back_to_recreate_under_auto_only() -> None:
    from elastic_runner.dist import DistError
    from elastic_runner.worker.group import _first_reconfigurable

    members = _RefusingMembers()
    created = _first_reconfigurable(members, 0, "auto", 1.0)  # type: ignore[arg-type]
    assert created is False, "the caller creates the group as any other"
    assert members.regroup.method == "recreate", "and rebuilds recreate it"
    with pytest.raises(DistError, match=r"recovery\.regroup: the gloo group of torch 9\.9 does not support "
                                        r"reconfigure\. Use auto .* or recreate"):
        _first_reconfigurable(_RefusingMembers(), 0, "reconfigure", 1.0)  # type: ignore[arg-type]
