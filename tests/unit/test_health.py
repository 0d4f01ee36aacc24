"""A node's health check: a device that is missing, or that computes a wrong, non-finite or no product, is named."""

from __future__ import annotations

import pytest
import torch

from elastic_runner.agent import health

CPU = torch.device("cpu")


def test_a_device_that_computes_right_passes() -> None:
    assert health.check_device(CPU) is None
    assert health.check_here("cpu", 4) is None


def test_one_wrong_entry_of_the_product_is_a_wrong_device() -> None:
    def one_bit_flipped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        product = a @ b
        product.view(torch.int32)[17, 42] ^= 1 << 20  # a flipped mantissa bit, as a failing unit would make
        return product

    problem = health.check_device(CPU, one_bit_flipped)
    assert problem is not None and "wrong 64x64 matmul" in problem and "1 of 4096" in problem and "cpu" in problem


def test_a_product_off_by_a_fraction_is_wrong_too() -> None:
    """Small integers are exact in every format a matmul uses: a fraction is no rounding, it is a fault."""
    problem = health.check_device(CPU, lambda a, b: a @ b + 0.25 * (a[:, :1] == 2))
    assert problem is not None and "wrong" in problem


def test_non_finite_values_and_a_failing_device_are_named() -> None:
    assert "non-finite" in (health.check_device(CPU, lambda a, b: (a @ b) / (a @ b - (a @ b))) or "")

    def lost(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    problem = health.check_device(CPU, lost)
    assert problem is not None and "failed to compute" in problem and "illegal memory access" in problem


@pytest.mark.skipif(health.gpu_driver(), reason="this machine has a GPU driver")
def test_a_node_without_a_driver_fails_a_cuda_job_and_passes_an_auto_one() -> None:
    assert health.check_node("cuda", 2) == "dist.device is cuda, and this node has no GPU driver"
    assert health.check_node("auto", 2) is None and health.check_node("cpu", 2) is None


def test_the_child_process_answers_in_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert health.main(["--kind", "cpu", "--count", "2"]) == 0
    assert capsys.readouterr().out.strip() == '{"problem": null}'


@pytest.mark.gpu
def test_a_healthy_gpu_node_passes_through_the_child_process() -> None:
    if not torch.cuda.is_available() or not health.gpu_driver():
        pytest.skip("needs a CUDA device (the production path); none here")
    assert health.check_node("cuda", torch.cuda.device_count()) is None
    assert health.check_node("auto", 1) is None
    problem = health.check_node("cuda", torch.cuda.device_count() + 1)
    assert problem is not None and "CUDA devices, and it has" in problem


# -- the network: where gloo listens ---------------------------------------------------------------------------

OTHER_MACHINE = "10.1.2.3"  # the c10d endpoint: another machine's address (resolved only, never reached)


def _machine(hostname_resolves_to: list[str], own: set[str]) -> dict[str, object]:
    """A machine whose hostname 'node-b' resolves to ``hostname_resolves_to`` and that has the addresses ``own``
    (and loopback); 'node-a' is the other machine."""
    names = {"node-b": hostname_resolves_to, "node-a": [OTHER_MACHINE], OTHER_MACHINE: [OTHER_MACHINE]}
    return {"hostname": "node-b", "resolve": lambda host: names.get(host, [host] if host[0].isdigit() else []),
            "bindable": lambda address: address in own or address.startswith("127.")}


def _network(endpoint: str = "node-a:29400", backend: str = "gloo", rdzv_backend: str = "c10d", max_nodes: int = 4,
             env: dict[str, str] | None = None, sharded_memory: bool = False,
             **machine: object) -> tuple[str | None, str | None]:
    gloo = health.workers_use_gloo(backend, "cuda" if backend == "nccl" else "cpu", sharded_memory)
    return health.network_problem(gloo=gloo, max_nodes=max_nodes, rdzv_backend=rdzv_backend,
                                  endpoint=endpoint, env=env or {}, **machine)  # type: ignore[arg-type]


def test_a_node_whose_hostname_maps_to_loopback_fails_a_job_that_spans_machines() -> None:
    """Debian's /etc/hosts maps the hostname to 127.0.1.1: gloo would listen there, out of the other machines' reach,
    and the job's first collective would hang on every node, round after round."""
    problem, doubt = _network(**_machine(["127.0.1.1"], own={"10.1.2.4"}))
    assert doubt is None and problem is not None
    assert "'node-b' resolves to 127.0.1.1, a loopback address" in problem and "GLOO_SOCKET_IFNAME" in problem
    problem, _ = _network(endpoint=f"{OTHER_MACHINE}:29400", **_machine([], own={"10.1.2.4"}))
    assert problem is not None and "falls back to loopback" in problem
    problem, _ = _network(backend="nccl", sharded_memory=True, **_machine(["127.0.1.1"], own={"10.1.2.4"}))
    assert problem is not None, "under nccl a sharded model's node-memory copies travel over gloo"


@pytest.mark.parametrize(("what", "kwargs"), [
    ("its hostname is its shared address", {"machine": (["10.1.2.4"], {"10.1.2.4"})}),
    ("an interface is named", {"env": {"GLOO_SOCKET_IFNAME": "eth0"}}),
    ("nccl picks its interface itself", {"backend": "nccl"}),
    ("one node at most", {"max_nodes": 1}),
    ("the endpoint is loopback: one machine", {"endpoint": "127.0.0.1:29400"}),
    ("the endpoint is localhost: one machine", {"endpoint": "localhost:0"}),
])
def test_a_node_that_others_can_reach_or_that_runs_alone_passes(what: str, kwargs: dict[str, object]) -> None:
    hostname, own = kwargs.pop("machine", (["127.0.1.1"], {"10.1.2.4"}))  # type: ignore[misc]
    assert _network(**kwargs, **_machine(hostname, own)) == (None, None), what  # type: ignore[arg-type]


@pytest.mark.parametrize(("what", "endpoint", "rdzv_backend"), [
    ("the endpoint is this machine (by its own name)", "node-b:29400", "c10d"),
    ("the endpoint is this machine (by its address)", "10.1.2.4:29400", "c10d"),
    ("etcd may run anywhere: it says nothing of where the nodes are", "node-a:2379", "etcd-v3"),
])
def test_where_the_job_may_run_on_this_machine_alone_it_is_a_warning(what: str, endpoint: str,
                                                                       rdzv_backend: str) -> None:
    problem, doubt = _network(endpoint=endpoint, rdzv_backend=rdzv_backend,
                              **_machine(["127.0.1.1"], own={"10.1.2.4"}))
    assert problem is None and doubt is not None and "if this job spans machines" in doubt, what


def test_the_agent_leaves_with_exit_5_before_any_round_when_its_workers_would_be_unreachable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from elastic_runner.agent import adopt
    from elastic_runner.config import Config

    machine = _machine(["127.0.1.1"], own={"10.1.2.4"})
    monkeypatch.setattr(health, "_resolve", machine["resolve"])
    monkeypatch.setattr(health, "_bindable", machine["bindable"])
    monkeypatch.setattr(health.socket, "gethostname", lambda: "node-b")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    cfg = Config()
    cfg.dist.device = "cpu"
    launch = SimpleNamespace(max_nodes=4, rdzv_backend="c10d", rdzv_endpoint="node-a:29400", nproc_per_node=2)
    with pytest.raises(SystemExit) as left:
        adopt._end_if_unhealthy(adopt._start_health_check(cfg, launch))
    assert left.value.code == 5
    assert "failed its health check" in caplog.text and "127.0.1.1" in caplog.text
