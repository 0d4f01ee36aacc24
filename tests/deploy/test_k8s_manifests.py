"""The Kubernetes manifests (k8s/), checked offline: no cluster is needed.

Every overlay renders with ``kubectl kustomize`` and every document in it validates strictly
(unknown fields are errors) against the Kubernetes schemas of the oldest and newest supported
versions, or, for the custom resources, against k8s/schemas/. Each training pod, as its
controller creates it, runs exactly the torchrun command documented in the docs. The workload,
config, rendezvous, snapshots (on a shared volume or in a bucket), grace period and network
policies fit together. Needs kubectl >= 1.27 (skipped with the reason otherwise).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from elastic_runner.config import Config, load_config
from elastic_runner.config.locations import is_url, location_problem

from .k8s_support import (
    K8S,
    KUBERNETES_VERSIONS,
    ROOT,
    WORKLOAD_KINDS,
    Peer,
    Schemas,
    WorkerPod,
    by_kind,
    canonical_command,
    configmap,
    container_argv,
    describe,
    dockerfile_entrypoint,
    documented_command,
    documented_command_source,
    egress_admits, ingress_admits,
    job_specs,
    one,
    quantity,
    render,
    resolve_env,
    torchrun_args,
    torchrun_dests,
    worker_pods,
)

MONITORING = K8S / "components" / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "elastic-runner.json"
# The manifests' own margin: the agent needs this long after its workers stopped.
AGENT_EXIT_MARGIN_SECONDS = 15
# The overlays without a shared volume (snapshots in a bucket), and the Job overlay each JobSet one derives from.
OBJECT_STORAGE_OVERLAYS = ("object-storage", "object-storage-jobset")
JOBSET_VARIANTS = {"object-storage-jobset": "object-storage"}
# botocore's variables for the object store's keys: never set in a manifest, not even from a Secret (the keys are a
# credentials file in the mounted Secret OBJECT_STORE_SECRET, which AWS_SHARED_CREDENTIALS_FILE names).
OBJECT_STORE_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
OBJECT_STORE_SECRET = "elastic-runner-object-store"


def pods_of(docs: list[dict[str, Any]]) -> list[WorkerPod]:
    pods = worker_pods(docs)
    assert pods, f"no training workload ({', '.join(WORKLOAD_KINDS)}) in the render"
    return pods


def nnodes(env: dict[str, str]) -> tuple[int, int]:
    low, _, high = env["PET_NNODES"].partition(":")
    return int(low), int(high or low)


def mount_path(pod: WorkerPod, volume_name: str, container: str = "pytorch") -> str:
    mounts = [m for m in pod.container(container).get("volumeMounts", []) if m["name"] == volume_name]
    assert mounts, f"{describe(pod.owner)}: container {container} does not mount volume {volume_name!r}"
    return mounts[0]["mountPath"]


def volume(pod: WorkerPod, name: str) -> dict[str, Any]:
    found = [v for v in pod.spec.get("volumes", []) if v["name"] == name]
    assert found, f"{describe(pod.owner)} has no volume {name!r}"
    return found[0]


def port(pod: WorkerPod, name: str) -> int:
    found = [p["containerPort"] for p in pod.container().get("ports", []) if p.get("name") == name]
    assert found, f"{describe(pod.owner)}: no container port named {name!r}"
    return found[0]


def all_pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    templates = [(describe(d), d["spec"]["template"]) for d in docs if d["kind"] in ("Job", "StatefulSet", "Deployment")]
    templates += [(describe(p.owner), p.template) for p in worker_pods(docs) if p.owner["kind"] in ("PyTorchJob", "JobSet")]
    return templates


def mounted_config(pod: WorkerPod, docs: list[dict[str, Any]], tmp_path: Path) -> Config:
    """The training config the pod reads (its --config file, from the ConfigMap mounted there)."""
    args = pod.container()["args"]
    config_path = Path(args[args.index("--config") + 1])
    data = configmap(docs, volume(pod, "config")["configMap"]["name"])["data"]
    return load_config_text(data[config_path.name], tmp_path / config_path.name)


def load_config_text(text: str, path: Path) -> Config:
    path.write_text(text)
    return load_config(path)


def disk_backed(volume_: dict[str, Any]) -> bool:
    """An emptyDir on the node's disk (its use counts as the pod's ephemeral storage; a memory-backed one as memory)."""
    return "emptyDir" in volume_ and volume_["emptyDir"].get("medium", "") != "Memory"


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping inside a document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# -- rendering and schemas ------------------------------------------------------------------------


def test_every_overlay_renders_a_workload_with_its_rendezvous(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    assert all(d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name") for d in docs)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ConfigMap", "StatefulSet", "Service"} <= kinds, kinds
    workloads = [describe(d) for d in docs if d["kind"] in WORKLOAD_KINDS]
    assert len(workloads) == 1, f"{name}: exactly one training workload, not {workloads}"
    names = [describe(d) for d in docs]
    assert len(names) == len(set(names)), f"{name}: duplicate documents {names}"


def test_every_document_validates_strictly_against_its_schema(
    overlay: tuple[str, list[dict[str, Any]]], schemas: dict[str, Schemas]
) -> None:
    name, docs = overlay
    errors = [f"Kubernetes {version}: {error}" for version, s in schemas.items() for doc in docs for error in s.errors(doc)]
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_custom_resource_schemas_reject_what_their_operators_reject(schemas: dict[str, Schemas]) -> None:
    """The shipped schemas are strict, not decorative: each of these mistakes is an error."""
    s = schemas[KUBERNETES_VERSIONS[-1]]
    template = {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}}
    good = {
        "PodMonitor": {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"},
                       "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "metrics"}]}},
        "PrometheusRule": {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "r"},
                           "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5m"}]}]}},
        "PyTorchJob": {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
                       "spec": {"elasticPolicy": {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "etcd-v3"},
                                "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "OnFailure",
                                                                   "template": template}}}},
        "JobSet": {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "j"},
                   "spec": {"successPolicy": {"operator": "All", "targetReplicatedJobs": ["workers"]},
                            "failurePolicy": {"maxRestarts": 3, "restartStrategy": "BlockingRecreate",
                                              "rules": [{"name": "InvalidConfig", "action": "FailJobSet",
                                                         "onJobFailureReasons": ["PodFailurePolicy"]}]},
                            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
                                "completionMode": "Indexed", "completions": 4, "parallelism": 4,
                                "template": {**template, "spec": {**template["spec"], "restartPolicy": "Never"}}}}}]}},
    }
    for doc in good.values():
        assert s.errors(doc) == [], describe(doc)

    def broken(kind: str, change: Any) -> list[str]:
        doc = copy.deepcopy(good[kind])
        change(doc)
        return s.errors(doc)

    assert broken("PodMonitor", lambda d: d["spec"].update(podMetricEndpoints=[]))  # misspelt field
    assert broken("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"))
    assert broken("PodMonitor", lambda d: d["spec"].pop("selector"))
    assert broken("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(record="x"))  # alert and record
    assert broken("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"))
    assert broken("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(severity="page"))
    assert broken("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
                  .update(name="trainer"))  # the operator needs a container named pytorch
    assert broken("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"].update(
        Master=d["spec"]["pytorchReplicaSpecs"].pop("Worker")))  # elasticPolicy without workers
    assert broken("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
                  .update(env={"A": "1"}))  # the embedded pod template is checked by Kubernetes' strict schema
    assert broken("PyTorchJob", lambda d: d["spec"]["elasticPolicy"].update(minReplicas="1"))
    assert broken("PyTorchJob", lambda d: d["metadata"].update(name="Trainer_1"))

    def replicated(d: dict[str, Any]) -> dict[str, Any]:
        return d["spec"]["replicatedJobs"][0]

    assert broken("JobSet", lambda d: d["spec"].update(replicatedJob=d["spec"].pop("replicatedJobs")))  # misspelt field
    assert broken("JobSet", lambda d: replicated(d)["template"]["spec"]["template"]["spec"]["containers"][0]
                  .update(env={"A": "1"}))  # the embedded pod template is checked by Kubernetes' strict schema
    assert broken("JobSet", lambda d: replicated(d)["template"]["spec"].update(parallelism="4"))  # and the Job's
    assert broken("JobSet", lambda d: replicated(d).update(replicas=-1))
    assert broken("JobSet", lambda d: replicated(d).update(name="Workers"))  # names the Jobs: DNS-1035
    assert broken("JobSet", lambda d: replicated(d).update(dependsOn=[{"name": "x", "status": "Ready"}]))  # the first
    assert broken("JobSet", lambda d: d["spec"]["successPolicy"].update(operator="Some"))
    assert broken("JobSet", lambda d: d["spec"]["failurePolicy"].update(maxRestarts="3"))
    assert broken("JobSet", lambda d: d["spec"]["failurePolicy"].update(restartStrategy="Blocking"))
    assert broken("JobSet", lambda d: d["spec"]["failurePolicy"]["rules"][0].update(action="FailJob"))
    assert broken("JobSet", lambda d: d["spec"]["failurePolicy"]["rules"][0].update(name="invalid config"))
    assert broken("JobSet", lambda d: d["spec"]["failurePolicy"]["rules"][0].update(onJobFailureReasons=["OOMKilled"]))
    assert broken("JobSet", lambda d: d["spec"].update(network={"enableDNSHostnames": "false"}))

    def second_after_the_first(d: dict[str, Any]) -> None:
        d["spec"]["replicatedJobs"].append({**copy.deepcopy(replicated(d)), "name": "more",
                                             "dependsOn": [{"name": "workers", "status": "Ready"}]})

    assert not broken("JobSet", second_after_the_first)
    assert broken("JobSet", lambda d: (second_after_the_first(d),  # dependsOn and startupPolicy InOrder exclude each other
                                       d["spec"].update(startupPolicy={"startupPolicyOrder": "InOrder"})))
    assert broken("JobSet", lambda d: d["metadata"].update(name="Trainer_1"))


# -- the torchrun command ------------------------------------------------------------------------


def test_each_training_pod_runs_the_documented_torchrun_command(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Rebuild each pod's command from its container args and environment (PyTorchJob: plus what
    the training operator adds) with torchrun's parser, and compare it with the Kubernetes guide's."""
    name, docs = overlay
    documented = documented_command()
    source = documented_command_source().relative_to(ROOT)
    assert documented.argv[:2] == ["elastic-runner", "launch"], f"{source}: the documented command is {documented}"
    expected = torchrun_args(documented.argv[2:], documented.env)
    for pod in pods_of(docs):
        env = resolve_env(pod, docs)
        argv = container_argv(pod)
        assert argv[:2] == documented.argv[:2], f"{name} {describe(pod.owner)} runs {argv}"
        actual = torchrun_args(argv[2:], env)
        assert vars(actual) == vars(expected), (
            f"{name} {describe(pod.owner)} runs\n  {canonical_command(actual, argv[:2])}\n"
            f"but {source} documents\n  {canonical_command(expected, argv[:2])}")
        other = {k: env.get(k) for k in documented.env}
        assert other == documented.env, f"{name} {describe(pod.owner)}: environment {other}, documented {documented.env}"


def test_every_PET_variable_is_a_torchrun_flag(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """torchrun ignores a misspelt PET_ variable silently; here it is an error."""
    name, docs = overlay
    dests = torchrun_dests()
    for pod in pods_of(docs):
        unknown = sorted(k for k in resolve_env(pod, docs) if k.startswith("PET_") and k[4:].lower() not in dests)
        assert not unknown, f"{name} {describe(pod.owner)}: {unknown} are not torchrun flags"


def test_no_container_defines_a_variable_twice(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    for owner, template in all_pod_templates(docs):
        for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            names = [v["name"] for v in c.get("env", [])]
            assert len(names) == len(set(names)), f"{name} {owner} {c['name']}: duplicate env {names}"


def test_the_documented_command_parses_like_a_shell_line() -> None:
    from .k8s_support import parse_documented_command

    text = ("<!-- k8s-command -->\n```sh\n# comment\nA=1 B=x=y \\\n  elastic-runner launch --nnodes=1:2 \\\n"
            "  -m mod --config 'a b'\n```\n<!-- /k8s-command -->")
    command = parse_documented_command(text)
    assert command.env == {"A": "1", "B": "x=y"}
    assert command.argv == ["elastic-runner", "launch", "--nnodes=1:2", "-m", "mod", "--config", "a b"]


# -- the workload ---------------------------------------------------------------------------------


def test_the_workload_scales_between_min_and_max_pods(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """An Indexed Job (the base's, or a JobSet's) whose completions are the most pods and whose parallelism the pods
    now; a PyTorchJob's elasticPolicy says the same."""
    name, docs = overlay
    for pod in pods_of(docs):
        low, high = nnodes(resolve_env(pod, docs))
        assert 1 <= low <= high, f"{name}: PET_NNODES={low}:{high}"
        owner = pod.owner
        if owner["kind"] in ("Job", "JobSet"):
            specs = job_specs(pod)
            assert len(specs) == 1, f"{name} {describe(owner)}: one Job runs the pods"
            spec = specs[0]
            assert spec["completionMode"] == "Indexed"
            assert spec["completions"] == high, "completions is the most pods that ever run: the max of PET_NNODES"
            assert low <= spec["parallelism"] <= high, f"{name}: parallelism {spec['parallelism']} outside {low}:{high}"
            assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}, "one finished pod finishes the run"
            assert pod.spec["restartPolicy"] == "Never"
            assert spec["podReplacementPolicy"] == "Failed", "never two pods for one index"
            rules = spec["podFailurePolicy"]["rules"]
            assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
            config_rule = [r for r in rules if r["action"] == "FailJob"]
            assert config_rule and config_rule[0]["onExitCodes"]["containerName"] in {
                c["name"] for c in pod.spec.get("initContainers", [])}, "FailJob must name the config check"
            excluded = [r for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
            assert excluded and excluded[0]["onExitCodes"]["values"] == [6] and \
                excluded[0]["onExitCodes"]["containerName"] in {c["name"] for c in pod.spec["containers"]}, \
                "a node taken out of the job (exit 6) is not the run's failure"
            names = {e["name"]: e for c in pod.spec["containers"] for e in c.get("env", [])}
            assert names["ELASTIC_RUNNER_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", \
                "an excluded machine is known by its name, not by the pod's"
            assert "selector" not in spec, "a Job's selector is generated; labels must not add one"
        else:
            assert owner["kind"] == "PyTorchJob", describe(owner)
            policy = owner["spec"]["elasticPolicy"]
            assert (policy["minReplicas"], policy["maxReplicas"]) == (low, high)
            replicas = owner["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
            assert low <= replicas <= high
            assert pod.spec["restartPolicy"] == owner["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"]


def test_a_jobset_restarts_its_group_only_for_what_a_restart_can_mend(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """One group of torchrun agents (a second Job would join the same rendezvous beyond the max). The set is done
    when that Job is (its successPolicy: the first pod that finished training); a Job that failed for an invalid
    config fails the set at once, any other failure (crashes beyond backoffLimit) recreates it a few times, the old
    pods gone first (they may still be writing their final snapshot)."""
    name, docs = overlay
    for jobset in by_kind(docs, "JobSet"):
        spec = jobset["spec"]
        assert [(r["name"], r["replicas"]) for r in spec["replicatedJobs"]] == [("workers", 1)], name
        assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["workers"]}
        policy = spec["failurePolicy"]
        assert policy["maxRestarts"] >= 1 and policy["restartStrategy"] == "BlockingRecreate"
        first_match = next(r for r in policy["rules"] if "PodFailurePolicy" in r.get("onJobFailureReasons", []))
        assert first_match["action"] == "FailJobSet", f"{name}: an invalid config is restarted"
        assert set(spec["network"]) == {"enableDNSHostnames"} and spec["network"]["enableDNSHostnames"] is False, (
            "pods announce their IP to etcd: no headless Service, no hostnames")


def test_the_grace_period_covers_the_graceful_stop(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Kubernetes must not SIGKILL a pod while torchrun still gives its workers time to save."""
    name, docs = overlay
    for pod in pods_of(docs):
        env = resolve_env(pod, docs)
        shutdown = int(env["PET_SHUTDOWN_TIMEOUT"])
        grace = pod.spec["terminationGracePeriodSeconds"]
        assert shutdown > 30, "torchrun's default (30 s) is what PET_SHUTDOWN_TIMEOUT is there to raise"
        assert grace >= shutdown + AGENT_EXIT_MARGIN_SECONDS, (
            f"{name}: terminationGracePeriodSeconds {grace} < PET_SHUTDOWN_TIMEOUT {shutdown} + {AGENT_EXIT_MARGIN_SECONDS}")
        entrypoint = pod.container().get("command") or dockerfile_entrypoint()
        assert entrypoint[0] == "tini", "PID 1 must forward SIGTERM (a Python PID 1 ignores it until torchrun's handler is set)"


def test_the_config_file_fits_the_pod(overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The mounted config is valid, keeps its run directory on the run volume and serves metrics where
    the pod (and the PodMonitor) expects them; the config check reads the same file."""
    name, docs = overlay
    for pod in pods_of(docs):
        args = pod.container()["args"]
        config_path = args[args.index("--config") + 1]
        config_dir = mount_path(pod, "config")
        assert Path(config_path).parent == Path(config_dir)
        data = configmap(docs, volume(pod, "config")["configMap"]["name"])["data"]
        assert Path(config_path).name in data, f"{name}: {config_path} is not in the ConfigMap"
        (tmp_path / "config.yaml").write_text(data[Path(config_path).name])
        config = load_config(tmp_path / "config.yaml")
        runs = mount_path(pod, "runs")
        assert Path(config.run.dir).is_relative_to(runs), f"{name}: run.dir {config.run.dir} is not on the volume at {runs}"
        assert config.metrics.port == port(pod, "metrics")
        assert int(resolve_env(pod, docs)["ELASTIC_RUNNER_AGENT_METRICS_PORT"]) == port(pod, "agent-metrics")
        assert config.metrics.bind in ("auto", "0.0.0.0")
        check = [c for c in pod.spec["initContainers"] if c["name"] == "check-config"][0]
        assert check["args"] == ["config", config_path] and check["image"] == pod.container()["image"]
        assert {m["mountPath"] for m in check["volumeMounts"] if m["name"] == "config"} == {config_dir}


def test_each_overlay_asks_for_the_hardware_its_config_uses(overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    name, docs = overlay
    for pod in pods_of(docs):
        data = configmap(docs, volume(pod, "config")["configMap"]["name"])["data"]
        (tmp_path / "config.yaml").write_text(data["config.yaml"])
        config = load_config(tmp_path / "config.yaml")
        env = resolve_env(pod, docs)
        limits = pod.container()["resources"].get("limits", {})
        if config.dist.device == "cuda":
            assert config.dist.backend == "nccl", f"{name}: GPUs train with NCCL"
            assert int(limits["nvidia.com/gpu"]) == int(env["PET_NPROC_PER_NODE"]), "one GPU per worker process"
            assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= set(env)
            shm = volume(pod, "dshm")["emptyDir"]
            assert shm["medium"] == "Memory" and mount_path(pod, "dshm") == "/dev/shm"
        else:
            assert config.dist.backend == "gloo" and config.dist.device == "cpu", f"{name}: CPU pods train with gloo"
            assert "nvidia.com/gpu" not in limits
        requests = pod.container()["resources"]["requests"]
        assert limits.get("memory") == requests["memory"], "memory limit = request: no overcommitted training pods"


def test_each_jobs_rendezvous_keys_are_its_own(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """A Job's pods scope their etcd keys by the Job's UID (a label the Job controller sets on every pod, a JobSet's
    Jobs' too): a signed value of an earlier run under the same rdzv id can never be put back into this one
    (docs/trust.md)."""
    _, docs = overlay
    for pod in pods_of(docs):
        if not job_specs(pod):
            continue  # a PyTorchJob's pods carry no such label: give each run its own rdzvId
        env = {e["name"]: e for e in pod.container().get("env", [])}
        scope = env.get("ELASTIC_RUNNER_RDZV_SCOPE")
        assert scope is not None, f"{describe(pod.owner)}: no ELASTIC_RUNNER_RDZV_SCOPE"
        assert scope["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"


def test_pods_run_unprivileged(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """The Pod Security Standard "restricted" profile's requirements, for every pod."""
    name, docs = overlay
    for owner, template in all_pod_templates(docs):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, f"{name} {owner}"
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", f"{name} {owner}"
        assert spec.get("automountServiceAccountToken") is False, f"{name} {owner}: no API access needed"
        assert spec.get("enableServiceLinks") is False, f"{name} {owner}: Service variables would reach etcd's config"
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], f"{name} {owner} {c['name']}"
            assert not sc.get("privileged")


def test_the_rendezvous_endpoint_is_the_etcd_service(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    etcd = one(docs, "StatefulSet", "etcd")
    etcd_labels = etcd["spec"]["template"]["metadata"]["labels"]
    etcd_ports = {p["name"]: p["containerPort"] for p in etcd["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for pod in pods_of(docs):
        env = resolve_env(pod, docs)
        assert env["PET_RDZV_BACKEND"] == "etcd-v3"
        for endpoint in env["PET_RDZV_ENDPOINT"].split(","):
            host, _, endpoint_port = endpoint.partition(":")
            service = one(docs, "Service", host)
            assert service["spec"]["selector"].items() <= etcd_labels.items(), f"{name}: Service {host} does not select etcd"
            ports = [p for p in service["spec"]["ports"] if p["port"] == int(endpoint_port)]
            assert ports, f"{name}: Service {host} has no port {endpoint_port}"
            assert etcd_ports[ports[0]["targetPort"]] == int(endpoint_port)
    env_of_etcd = {v["name"]: v.get("value") for v in etcd["spec"]["template"]["spec"]["containers"][0]["env"]}
    members = env_of_etcd["ETCD_INITIAL_CLUSTER"].split(",")
    assert len(members) == etcd["spec"]["replicas"], f"{name}: ETCD_INITIAL_CLUSTER lists {len(members)} members"
    assert [m.split("=")[0] for m in members] == [f"etcd-{i}" for i in range(len(members))]
    assert all(f".{etcd['spec']['serviceName']}:" in m for m in members)
    assert one(docs, "Service", etcd["spec"]["serviceName"])["spec"]["publishNotReadyAddresses"] is True
    if len(members) > 1:
        assert etcd["spec"]["podManagementPolicy"] == "Parallel", "members of a new cluster must start together"
        pdb = one(docs, "PodDisruptionBudget", "etcd")
        assert pdb["spec"]["minAvailable"] == len(members) // 2 + 1, "drains must keep the quorum"


def test_only_the_jobs_own_pods_reach_the_training_pods(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """torch's TCPStores (rendezvous, MASTER_PORT) and gloo/NCCL take unauthenticated connections on every
    interface: the NetworkPolicy is what keeps the rest of the cluster out."""
    name, docs = overlay
    stranger = Peer({"app": "some-other-workload"})
    prometheus = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    impostor = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="someone-elses")  # labels itself so
    for pod in pods_of(docs):
        labels = pod.template["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for p in pod.container().get("ports", [])}
        for any_port in (29500, 29400, 41234):  # the stores' and process group's ports are picked at run time
            assert ingress_admits(docs, labels, ports, Peer(dict(labels)), any_port), f"{name}: peers cut off"
            assert not ingress_admits(docs, labels, ports, stranger, any_port), f"{name}: a stranger reaches {any_port}"
            assert not ingress_admits(docs, labels, ports, prometheus, any_port), f"{name}: Prometheus reaches {any_port}"
        for metrics in ("metrics", "agent-metrics"):
            assert ingress_admits(docs, labels, ports, prometheus, port(pod, metrics)), f"{name}: {metrics} not scraped"
            assert not ingress_admits(docs, labels, ports, stranger, port(pod, metrics))
            assert not ingress_admits(docs, labels, ports, impostor, port(pod, metrics)), \
                f"{name}: a pod of another namespace that calls itself prometheus reaches {metrics}"


def test_the_training_pods_reach_their_peers_etcd_dns_and_https_and_nothing_else(
        overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """A worker turned against the cluster (a bad input, a compromised dependency) reaches only what a job needs."""
    name, docs = overlay
    etcd = Peer({"app.kubernetes.io/name": "etcd", "app.kubernetes.io/part-of": "elastic-runner"})
    dns = Peer({"k8s-app": "kube-dns"}, namespace="kube-system")
    elsewhere = Peer({"app": "a-database"}, namespace="data")
    for pod in pods_of(docs):
        labels = pod.template["metadata"]["labels"]
        assert egress_admits(docs, labels, Peer(dict(labels)), 29500), f"{name}: workers cannot reach each other"
        assert egress_admits(docs, labels, etcd, 2379), f"{name}: workers cannot reach etcd's client port"
        assert not egress_admits(docs, labels, etcd, 2380), f"{name}: a worker reaches etcd's peer port"
        assert egress_admits(docs, labels, dns, 53, "UDP") and egress_admits(docs, labels, dns, 53, "TCP"), name
        assert egress_admits(docs, labels, elsewhere, 443), f"{name}: no HTTPS (object stores, hubs)"
        for port_ in (5432, 6379, 8080, 10250):
            assert not egress_admits(docs, labels, elsewhere, port_), f"{name}: a worker reaches port {port_}"


def test_etcd_takes_clients_only_from_the_training_pods_and_peers_only_from_its_members(
        overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    etcd = one(docs, "StatefulSet", "etcd")
    labels = etcd["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in etcd["spec"]["template"]["spec"]["containers"][0]["ports"]}
    workers = [Peer(dict(p.template["metadata"]["labels"])) for p in pods_of(docs)]
    member, stranger = Peer(dict(labels)), Peer({"app": "some-other-workload"})
    for worker in workers:
        assert ingress_admits(docs, labels, ports, worker, ports["client"]), f"{name}: workers cannot reach etcd"
        assert not ingress_admits(docs, labels, ports, worker, ports["peer"]), f"{name}: a worker reaches the peer port"
    assert not ingress_admits(docs, labels, ports, stranger, ports["client"]), f"{name}: anyone reaches etcd's keys"
    assert not ingress_admits(docs, labels, ports, stranger, ports["peer"])
    assert ingress_admits(docs, labels, ports, member, ports["peer"]), f"{name}: members cannot form a cluster"
    assert ingress_admits(docs, labels, ports, stranger, ports["metrics"]), f"{name}: probes and scrapes refused"


def test_the_rendezvous_is_authenticated_end_to_end(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """etcd demands client certificates over TLS; every pod signs rendezvous values with the job's key; both
    come from Secrets mounted read-only (never from variables, which end up in logs and `kubectl describe`)."""
    name, docs = overlay
    etcd = one(docs, "StatefulSet", "etcd")
    etcd_env = {v["name"]: v.get("value") for v in etcd["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert etcd_env["ETCD_CLIENT_CERT_AUTH"] == "true" and etcd_env["ETCD_TRUSTED_CA_FILE"], f"{name}: etcd without TLS"
    assert all(u.startswith("https://") for u in etcd_env["ETCD_ADVERTISE_CLIENT_URLS"].split(","))
    for pod in pods_of(docs):
        env = resolve_env(pod, docs)
        conf = dict(item.split("=", 1) for item in env["PET_RDZV_CONF"].split(","))
        assert "password" not in conf, f"{name}: a password in the command line"
        for key, secret in (("cacert", "elastic-runner-etcd-client"), ("cert", "elastic-runner-etcd-client"),
                            ("key", "elastic-runner-etcd-client"), ("auth_key_file", "elastic-runner-rdzv-key")):
            path = Path(conf[key])
            mounted = [v for v in pod.spec["volumes"] if v.get("secret", {}).get("secretName") == secret]
            assert mounted, f"{name}: Secret {secret} is not mounted"
            assert mounted[0]["secret"]["defaultMode"] & 0o007 == 0, f"{name}: {secret} readable by every user"
            assert str(path.parent) == mount_path(pod, mounted[0]["name"]), f"{name}: {key}={path} is not in {secret}"
        assert not any("secretKeyRef" in str(v) for v in pod.container().get("env", [])), f"{name}: a secret in env"
        assert not any("secretRef" in source for source in pod.container().get("envFrom", [])), f"{name}: a Secret as env"


def test_every_pod_finds_the_snapshots_on_one_shared_volume_or_in_one_bucket(
        overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """A pod may start on any node and must resume from the newest snapshot whoever wrote it. Either the run
    directory, and the snapshots in it, is one ReadWriteMany volume that every pod mounts; or the snapshots are in
    a bucket, and the run directory (staging copy, read cache, the pod's records) is the pod's own emptyDir on the
    node's disk, bounded by its sizeLimit, which the pod's ephemeral-storage request reserves."""
    name, docs = overlay
    for pod in pods_of(docs):
        config = mounted_config(pod, docs, tmp_path)
        runs, mounted_at = volume(pod, "runs"), mount_path(pod, "runs")
        if is_url(config.snapshot_dir):
            assert location_problem(config.snapshot_dir) is None, f"{name}: {location_problem(config.snapshot_dir)}"
            assert disk_backed(runs) and set(runs) == {"name", "emptyDir"}, f"{name}: run.dir is on {runs}, not the pod's disk"
            size = quantity(runs["emptyDir"]["sizeLimit"])
            requested = quantity(pod.container()["resources"]["requests"]["ephemeral-storage"])
            assert requested >= size, f"{name}: the pod requests {requested:.0f} B of ephemeral storage, its run directory may use {size:.0f}"
        else:
            claim = runs["persistentVolumeClaim"]["claimName"]
            pvc = one(docs, "PersistentVolumeClaim", claim)
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], f"{name}: every pod on every node writes the run directory"
            assert Path(config.snapshot_dir).is_relative_to(mounted_at), f"{name}: snapshots in {config.snapshot_dir}, not on {claim}"


def test_every_disk_backed_emptydir_fits_in_the_pods_ephemeral_storage_limit(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """The kubelet evicts a pod whose disk use (emptyDirs, logs, writable layers) passes the sum of its containers'
    limits: each emptyDir must be able to fill up to its own sizeLimit first."""
    name, docs = overlay
    for pod in pods_of(docs):
        dirs = [v for v in pod.spec["volumes"] if disk_backed(v)]
        assert all("sizeLimit" in v["emptyDir"] for v in dirs), f"{name}: an emptyDir without sizeLimit"
        total = sum(quantity(v["emptyDir"]["sizeLimit"]) for v in dirs)
        limit = sum(quantity(c["resources"]["limits"]["ephemeral-storage"]) for c in pod.spec["containers"])
        assert limit >= total, f"{name}: ephemeral-storage limit {limit:.0f} B < the emptyDirs' {total:.0f} B"


def test_everything_a_pod_refers_to_is_in_the_render(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Service account, ConfigMaps and claims exist; a claim that no pod mounts is not rendered."""
    name, docs = overlay
    claimed = set()
    for pod in pods_of(docs):
        one(docs, "ServiceAccount", pod.spec["serviceAccountName"])
        for cm in [v["configMap"]["name"] for v in pod.spec["volumes"] if "configMap" in v] + [
                s["configMapRef"]["name"] for s in pod.container().get("envFrom", [])]:
            configmap(docs, cm)
        for claim in [v["persistentVolumeClaim"]["claimName"] for v in pod.spec["volumes"] if "persistentVolumeClaim" in v]:
            one(docs, "PersistentVolumeClaim", claim)
            claimed.add(claim)
    unused = {pvc["metadata"]["name"] for pvc in by_kind(docs, "PersistentVolumeClaim")} - claimed
    assert not unused, f"{name}: claims no pod mounts: {sorted(unused)}"


def test_labels_select_the_pods(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """The base's labels reach every training pod (the PodMonitor selects on them)."""
    name, docs = overlay
    for pod in pods_of(docs):
        labels = pod.template["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "elastic-runner" and labels["app.kubernetes.io/component"] == "worker"
    for monitor in by_kind(docs, "PodMonitor"):
        for pod in pods_of(docs):
            assert monitor["spec"]["selector"]["matchLabels"].items() <= pod.template["metadata"]["labels"].items()
            names = {p["name"] for p in pod.container()["ports"]}
            scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
            assert scraped == {"metrics", "agent-metrics"} and scraped <= names, f"{name}: scrapes {scraped}, pod has {names}"


def test_only_the_base_sets_selector_labels() -> None:
    """Selectors are immutable on a live object: one place decides them (the style guide)."""
    for path in sorted(K8S.rglob("kustomization.yaml")):
        kustomization = yaml.safe_load(path.read_text())
        assert "commonLabels" not in kustomization, path
        if path.parent != K8S / "base":
            assert "labels" not in kustomization, f"{path.relative_to(ROOT)}: labels belong in k8s/base"
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert all(entry["includeSelectors"] for entry in base["labels"])


def test_the_production_overlays_include_monitoring(kubectl: str) -> None:
    for name in ("gpu", "gpu-pytorchjob"):
        docs = render(kubectl, K8S / "overlays" / name)
        kinds = {d["kind"] for d in docs}
        assert {"PodMonitor", "PrometheusRule"} <= kinds, name
        dashboard = [d for d in by_kind(docs, "ConfigMap") if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
        assert len(dashboard) == 1 and json.loads(dashboard[0]["data"]["elastic-runner.json"]) == json.loads(DASHBOARD.read_text())


def test_the_pytorchjob_variant_runs_the_gpu_overlays_pods(kubectl: str) -> None:
    """The pods of the gpu overlay's Job (image, resources, NCCL, volumes); only the restart policy differs."""
    job = one(render(kubectl, K8S / "overlays" / "gpu"), "Job")
    pytorchjob = one(render(kubectl, K8S / "overlays" / "gpu-pytorchjob"), "PyTorchJob")
    template = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    expected = copy.deepcopy(job["spec"]["template"])
    expected["spec"]["restartPolicy"] = "OnFailure"
    assert template == expected
    assert pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == job["spec"]["parallelism"]


def test_the_jobset_variant_runs_the_pods_of_the_job_overlay_it_derives_from(
        kubectl: str, schemas: dict[str, Schemas]) -> None:
    """The JobSet's one replicatedJob is the Job overlay's Job spec as it is: the same pods (image, command,
    PET_* variables and rendezvous, volumes, resources), completions, parallelism and policies; and the JobSet
    validates against its schema."""
    for variant, origin in JOBSET_VARIANTS.items():
        job = one(render(kubectl, K8S / "overlays" / origin), "Job")
        jobset = one(render(kubectl, K8S / "overlays" / variant), "JobSet")
        [replicated] = jobset["spec"]["replicatedJobs"]
        assert replicated["template"]["spec"] == job["spec"], variant
        assert replicated["template"]["metadata"]["labels"] == jobset["metadata"]["labels"] == job["metadata"]["labels"]
        assert jobset["metadata"]["name"] == job["metadata"]["name"]
        for version, s in schemas.items():
            assert s.errors(jobset) == [], f"Kubernetes {version}"


def test_the_object_storage_overlays_claim_no_volume(kubectl: str) -> None:
    """Without a ReadWriteMany storage class there is nothing to claim: no PersistentVolumeClaim, no pod volume
    (persistent or generic ephemeral) and no StatefulSet claim template that asks for one."""
    for name in OBJECT_STORAGE_OVERLAYS:
        docs = render(kubectl, K8S / "overlays" / name)
        assert not by_kind(docs, "PersistentVolumeClaim"), name
        for owner, template in all_pod_templates(docs):
            claims = [v["name"] for v in template["spec"].get("volumes", []) if {"persistentVolumeClaim", "ephemeral"} & set(v)]
            assert not claims, f"{name} {owner}: volumes {claims} claim storage"
        assert not any(sts["spec"].get("volumeClaimTemplates") for sts in by_kind(docs, "StatefulSet")), name


def test_the_object_storage_overlays_keep_the_snapshots_in_a_bucket_and_the_run_on_each_pod(
        kubectl: str, tmp_path: Path) -> None:
    """snapshot.dir is an s3:// URL (a placeholder bucket to change), run.dir is on the pod's emptyDir, and
    everything else is the base's training (cpu-dev's): the same model, data, schedule and snapshot cadence."""
    base = load_config_text((K8S / "base" / "config.yaml").read_text(), tmp_path / "base.yaml")
    for name in OBJECT_STORAGE_OVERLAYS:
        docs = render(kubectl, K8S / "overlays" / name)
        for pod in pods_of(docs):
            config = mounted_config(pod, docs, tmp_path)
            assert config.snapshot.dir and config.snapshot.dir.startswith("s3://"), f"{name}: snapshot.dir {config.snapshot.dir}"
            assert "emptyDir" in volume(pod, "runs") and Path(config.run.dir).is_relative_to(mount_path(pod, "runs"))
            ours, theirs = config.to_dict(), base.to_dict()
            del ours["snapshot"]["dir"], theirs["snapshot"]["dir"]
            assert ours == theirs, f"{name}: the config differs from the base's beyond snapshot.dir"


def test_the_object_storage_credentials_are_a_file_from_an_optional_secret_or_a_role(kubectl: str) -> None:
    """The keys are an AWS shared-credentials file, the key ``credentials`` of the Secret the user creates, mounted
    read-only, readable by the pod's group only and optional, so that pods whose ServiceAccount has a role (IRSA,
    Pod Identity, Workload Identity) start without it; AWS_SHARED_CREDENTIALS_FILE names that file. The endpoint and
    region are plain values, and no endpoint is set: unset means AWS S3."""
    for name in OBJECT_STORAGE_OVERLAYS:
        docs = render(kubectl, K8S / "overlays" / name)
        for pod in pods_of(docs):
            mounted = [v for v in pod.spec["volumes"] if v.get("secret", {}).get("secretName") == OBJECT_STORE_SECRET]
            assert len(mounted) == 1, f"{name}: Secret {OBJECT_STORE_SECRET} mounted {len(mounted)} times"
            secret = mounted[0]["secret"]
            assert secret.get("optional") is True, f"{name}: pods with a role and no Secret would not start"
            assert secret.get("defaultMode") == 0o440, f"{name}: {OBJECT_STORE_SECRET} with mode {secret.get('defaultMode')}"
            assert all(item.get("mode", 0o440) == 0o440 for item in secret.get("items", [])), name
            mounts = [m for m in pod.container().get("volumeMounts", []) if m["name"] == mounted[0]["name"]]
            assert len(mounts) == 1 and mounts[0].get("readOnly") is True, f"{name}: {mounts} not read-only"
            assert "subPath" not in mounts[0], f"{name}: a subPath mount never sees a rotated Secret"
            # Each key is a file named after it, unless `items` maps it elsewhere.
            paths = {item["key"]: item["path"] for item in secret.get("items", [])} or {"credentials": "credentials"}
            assert "credentials" in paths, f"{name}: the Secret's key `credentials` is not mounted"
            env = {v["name"]: v for v in pod.container().get("env", [])}
            credentials_file = env["AWS_SHARED_CREDENTIALS_FILE"]
            assert set(credentials_file) == {"name", "value"}, f"{name}: {credentials_file}"
            assert Path(credentials_file["value"]) == Path(mounts[0]["mountPath"]) / paths["credentials"], (
                f"{name}: AWS_SHARED_CREDENTIALS_FILE={credentials_file['value']} is not the mounted credentials file")
            assert "AWS_ENDPOINT_URL" not in env, f"{name}: an endpoint set by default (unset: AWS S3)"
            for setting in ("AWS_ENDPOINT_URL", "AWS_REGION"):  # not secret: where they are set, plain values
                assert setting not in env or set(env[setting]) == {"name", "value"}, f"{name}: {env[setting]}"
            assert one(docs, "ServiceAccount", pod.spec["serviceAccountName"])["automountServiceAccountToken"] is False


def test_no_manifest_holds_object_store_credentials(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """An access key, secret key or session token is never a variable: no entry of that name, anywhere, has a value
    or a valueFrom (a Secret's key in a variable is in every child's /proc/PID/environ and in crash dumps), and no
    ConfigMap or rendered Secret carries one, as a key or as a credentials file."""
    name, docs = overlay
    for doc in docs:
        for node in walk(doc):
            assert not (node.get("name") in OBJECT_STORE_CREDENTIALS and ("value" in node or "valueFrom" in node)), (
                f"{name} {describe(doc)}: {node['name']} is set as a variable")
        if doc["kind"] in ("ConfigMap", "Secret"):
            keys = set(doc.get("data", {})) | set(doc.get("stringData", {}))
            assert not keys & set(OBJECT_STORE_CREDENTIALS), f"{name} {describe(doc)} holds {sorted(keys)}"
            texts = [*doc.get("stringData", {}).values()] + [
                base64.b64decode(v).decode(errors="replace") if doc["kind"] == "Secret" else v
                for v in doc.get("data", {}).values()]
            assert not any("aws_secret_access_key" in text.lower() for text in texts), f"{name} {describe(doc)} holds keys"
