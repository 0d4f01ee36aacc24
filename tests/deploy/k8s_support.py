"""Offline helpers for the deployment checks (tests/deploy): render kustomize overlays, validate
documents against Kubernetes and custom-resource schemas, rebuild each pod's torchrun command
from its environment (as the kubelet and, for PyTorchJobs, the Kubeflow training operator
would set it; a JobSet's pods are its Jobs' pods), and find the tools (kubectl, promtool) the
tests need.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from elastic_runner.testing import debian

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SCHEMAS = K8S / "schemas"
COMMAND_MARKERS = ("<!-- k8s-command -->", "<!-- /k8s-command -->")
# The oldest Kubernetes the manifests support (successPolicy is beta and on from 1.31)
# and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
MIN_KUSTOMIZE = (5, 0)

# What the kubelet puts into a variable taken from the pod (valueFrom.fieldRef), as written
# in the documented command.
FIELD_REF_PLACEHOLDERS = {"status.podIP": "$POD_IP"}
# The kinds whose pods train: the base's Job and the variants the components make of it.
WORKLOAD_KINDS = ("Job", "PyTorchJob", "JobSet")

# Metrics of the launcher (torchrun agent) as listed in issue 5; elastic_runner.agent.launch exports
# them on ELASTIC_RUNNER_AGENT_METRICS_PORT. Name -> type.
AGENT_METRICS = {
    "elastic_runner_agent_remaining_restarts": "gauge",
    "elastic_runner_agent_rendezvous_total": "counter",
    "elastic_runner_agent_rendezvous_duration_seconds": "histogram",
    "elastic_runner_agent_worker_failures_total": "counter",
    "elastic_runner_agent_worker_group_state": "gauge",
}


# -- tools -------------------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def kubectl_problem(binary: str | None) -> str | None:
    """Why ``binary`` cannot render the overlays, or None if it can."""
    if binary is None:
        return "kubectl is not installed"
    try:
        out = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        kustomize = json.loads(out).get("kustomizeVersion", "")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return f"`{binary} version --client` failed: {exc}"
    if _version_tuple(kustomize)[:2] < MIN_KUSTOMIZE:
        return (f"{binary} bundles kustomize {kustomize or '(unknown)'}; the manifests need kustomize >= "
                f"v{MIN_KUSTOMIZE[0]}.{MIN_KUSTOMIZE[1]} (components, labels, replacements): kubectl >= 1.27")
    return None


def _apt_candidate(package: str) -> bool:
    try:
        out = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    match = re.search(r"Candidate:\s*(\S+)", out)
    return bool(match) and match.group(1) != "(none)"


def apt_install(package: str) -> bool:
    """``apt-get install -y PACKAGE`` as root when Debian offers it; True if it ran and succeeded."""
    if not debian.can_install() or not _apt_candidate(package):
        return False
    try:
        return debian.apt_install(package).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def find_kubectl() -> tuple[str | None, str]:
    """A kubectl that can render the overlays, or (None, why not).

    Debian has no ``kubectl`` package (it comes from Kubernetes' or Google Cloud's own apt
    repositories); bookworm's ``kubernetes-client`` is kubectl 1.20 with kustomize v2.0.3, too
    old for components. So the set-up installs ``kubectl`` only where an apt source offers it.
    """
    binary = shutil.which("kubectl")
    problem = kubectl_problem(binary)
    if problem and binary is None and apt_install("kubectl"):
        binary = shutil.which("kubectl")
        problem = kubectl_problem(binary)
    if problem:
        return None, (f"{problem} (Debian offers no kubectl package; bookworm's kubernetes-client 1.20 is too old "
                      "for kustomize components). Install kubectl >= 1.27 (https://kubernetes.io/docs/tasks/tools/) "
                      "to render and validate k8s/")
    return binary, ""


def find_promtool() -> tuple[str | None, str]:
    """promtool (Debian package ``prometheus``, installed as root when missing), or (None, why not)."""
    binary = shutil.which("promtool")
    if binary is None and apt_install("prometheus"):
        binary = shutil.which("promtool")
    if binary is None:
        return None, ("promtool is not installed and Debian's prometheus package could not be installed "
                      "(the set-up does that as root with apt-get)")
    return binary, ""


# -- rendering -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _render(kubectl: str, path: str) -> str:
    result = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"`kubectl kustomize {path}` failed:\n{result.stderr}")
    return result.stdout


def render(kubectl: str, path: Path) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize PATH`` prints (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_render(kubectl, str(path))) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}{' ' + name if name else ''}, found {len(found)}"
    return found[0]


def describe(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# -- schemas -----------------------------------------------------------------------------------


class SchemaNotFound(LookupError):
    pass


class Schemas:
    """Strict validators: Kubernetes' own kinds from kubernetes-validate's bundled schemas, the
    custom resources from k8s/schemas/ (which reuse Kubernetes' definitions by reference)."""

    def __init__(self, kubernetes_version: str) -> None:
        import importlib.resources

        import jsonschema  # noqa: F401 - a dependency of kubernetes-validate
        import kubernetes_validate
        from referencing import Registry, Resource

        base = importlib.resources.files(kubernetes_validate) / "kubernetes-json-schema"
        self.dir = base / f"v{kubernetes_version}-local-strict"
        if not self.dir.is_dir():
            raise SchemaNotFound(f"kubernetes-validate has no schemas for Kubernetes {kubernetes_version}")
        definitions = json.loads((self.dir / "_definitions.json").read_text())
        self.registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
        self.version = kubernetes_version
        self._validators: dict[tuple[str, str], Any] = {}
        self.custom = {}
        for path in sorted(SCHEMAS.glob("*.yaml")):
            schema = yaml.safe_load(path.read_text())
            props = schema["properties"]
            self.custom[(props["apiVersion"]["const"], props["kind"]["const"])] = schema

    def validator(self, api_version: str, kind: str) -> Any:
        from jsonschema import Draft202012Validator

        key = (api_version, kind)
        if key not in self._validators:
            if key in self.custom:
                schema = self.custom[key]
            else:
                # kubernetes-validate's file naming: rbac.authorization.k8s.io/v1 -> rbac-v1.
                group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
                path = self.dir / f"{kind.lower()}-{group_version}.json"
                if not path.is_file():
                    raise SchemaNotFound(f"no schema for {kind} {api_version} (Kubernetes {self.version})")
                schema = json.loads(path.read_text())
            self._validators[key] = Draft202012Validator(schema, registry=self.registry)
        return self._validators[key]

    def errors(self, doc: dict[str, Any]) -> list[str]:
        validator = self.validator(doc["apiVersion"], doc["kind"])
        return [f"{describe(doc)}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}"
                for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


# -- pods and their environment ----------------------------------------------------------------------


@dataclass
class WorkerPod:
    """A training pod template as its controller will create it."""

    owner: dict[str, Any]
    template: dict[str, Any]
    # Variables the controller appends to the container's env (the training operator does).
    controller_env: list[dict[str, Any]] = field(default_factory=list)

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    def container(self, name: str = "pytorch") -> dict[str, Any]:
        found = [c for c in self.spec["containers"] if c["name"] == name]
        assert found, f"{describe(self.owner)} has no container {name!r}"
        return found[0]


def training_operator_env(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The variables the Kubeflow training operator (v1.7-v1.9) appends to every container of
    an elastic PyTorchJob's Worker pods: its ElasticEnvVarGenerator, after PYTHONUNBUFFERED."""
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    env = [{"name": "PYTHONUNBUFFERED", "value": "0"}]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    assert "rdzvPort" in policy, "without rdzvPort the operator uses the container port 'pytorchjob-port'"
    env.append({"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{policy['rdzvPort']}"})
    env.append({"name": "PET_RDZV_BACKEND", "value": policy.get("rdzvBackend", "c10d")})
    if "minReplicas" in policy or "maxReplicas" in policy:
        nnodes = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        nnodes = str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])
    env.append({"name": "PET_NNODES", "value": nnodes})
    if "maxRestarts" in policy:
        env.append({"name": "PET_MAX_RESTARTS", "value": str(policy["maxRestarts"])})
    if "nProcPerNode" in policy:
        env.append({"name": "PET_NPROC_PER_NODE", "value": str(policy["nProcPerNode"])})
    if "rdzvId" in policy:
        env.append({"name": "PET_RDZV_ID", "value": policy["rdzvId"]})
    if policy.get("rdzvConf"):
        env.append({"name": "PET_RDZV_CONF", "value": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])})
    if policy.get("standalone"):
        env.append({"name": "PET_STANDALONE", "value": ""})
    return env


def worker_pods(docs: list[dict[str, Any]]) -> list[WorkerPod]:
    pods = [WorkerPod(job, job["spec"]["template"]) for job in by_kind(docs, "Job")]
    for job in by_kind(docs, "PyTorchJob"):
        for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items():
            extra = training_operator_env(job) if "elasticPolicy" in job["spec"] and replica_type == "Worker" else []
            pods.append(WorkerPod(job, replica["template"], extra))
    for jobset in by_kind(docs, "JobSet"):
        # The JobSet controller creates each replicatedJob's Jobs from its template as they are.
        pods += [WorkerPod(jobset, replicated["template"]["spec"]["template"]) for replicated in jobset["spec"]["replicatedJobs"]]
    return pods


def job_specs(pod: WorkerPod) -> list[dict[str, Any]]:
    """The specs of the Jobs that create ``pod``: a Job's own, or those of a JobSet's replicatedJobs with
    that pod template (a PyTorchJob's operator creates pods itself: none)."""
    if pod.owner["kind"] == "Job":
        return [pod.owner["spec"]]
    if pod.owner["kind"] == "JobSet":
        return [r["template"]["spec"] for r in pod.owner["spec"]["replicatedJobs"]
                if r["template"]["spec"]["template"] is pod.template]
    return []


def resolve_env(pod: WorkerPod, docs: list[dict[str, Any]], container: str = "pytorch") -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env in order
    (a later entry of the same name wins), $(VAR) references expanded, pod fields as placeholders.
    A Secret's key in a variable is refused: Secrets are mounted as files, never passed as variables."""
    c = pod.container(container)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        assert set(source) <= {"configMapRef", "prefix"}, f"unsupported envFrom {source}"
        env.update({source.get("prefix", "") + k: v for k, v in configmap(docs, source["configMapRef"]["name"])["data"].items()})
    for var in c.get("env", []) + pod.controller_env:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = FIELD_REF_PLACEHOLDERS.get(path, f"$({path})")
        elif "secretKeyRef" in var.get("valueFrom", {}):
            raise AssertionError(f"{var['name']} is taken from a Secret: mount the Secret as a file instead ({var})")
        else:
            raise AssertionError(f"unsupported env source {var}")
    return env


def configmap(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return one(docs, "ConfigMap", name)


_QUANTITY_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(text: str | int) -> float:
    """A Kubernetes resource quantity ("2Gi", "500M", "1.5", 3) as a number (bytes for storage)."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match and match.group(2) in _QUANTITY_SUFFIXES, f"not a quantity: {text!r}"
    return float(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)]


# -- commands -----------------------------------------------------------------------------------


@dataclass
class Command:
    env: dict[str, str]
    argv: list[str]

    def __str__(self) -> str:
        return " ".join([f"{k}={v}" for k, v in self.env.items()] + [shlex.quote(a) for a in self.argv])


def documented_command_source() -> Path:
    """The Kubernetes guide carries the command between the k8s-command markers."""
    return ROOT / "docs" / "guides" / "kubernetes.md"


def parse_documented_command(text: str) -> Command:
    """The shell command between the k8s-command markers: optional VAR=value prefixes, then the
    program and its arguments; backslash continuations, code fences and # comments allowed."""
    start, end = COMMAND_MARKERS
    assert start in text and end in text, f"no {start} ... {end} block"
    block = text.split(start, 1)[1].split(end, 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith(("```", "#"))]
    words = shlex.split(" ".join(line.rstrip().removesuffix("\\") for line in lines))
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return Command(env, words)


def documented_command() -> Command:
    return parse_documented_command(documented_command_source().read_text())


def dockerfile_entrypoint(path: Path = ROOT / "Dockerfile") -> list[str]:
    """The image's ENTRYPOINT (exec form; the last one counts)."""
    entries = [json.loads(args) for instruction, args in dockerfile_instructions(path) if instruction == "ENTRYPOINT"]
    assert entries, "the Dockerfile has no ENTRYPOINT"
    return entries[-1]


def dockerfile_instructions(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and blank lines
    (also those inside a continued instruction) dropped, the parser directive line skipped."""
    instructions: list[tuple[str, str]] = []
    parts: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            word, _, rest = " ".join(parts).partition(" ")
            instructions.append((word.upper(), rest.strip()))
            parts = []
    return instructions


def container_argv(pod: WorkerPod, container: str = "pytorch") -> list[str]:
    """What the container runs: its command, or the image's ENTRYPOINT (from the Dockerfile),
    followed by its args; an init wrapper (tini --) left out."""
    c = pod.container(container)
    argv = list(c.get("command") or dockerfile_entrypoint()) + list(c.get("args", []))
    if argv[:2] == ["tini", "--"]:
        argv = argv[2:]
    return argv


@contextlib.contextmanager
def torchrun_environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ with exactly the given PET_* variables (torchrun's parser reads them)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("PET_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("PET_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("PET_")]:
            del os.environ[key]
        os.environ.update(saved)


def torchrun_args(launch_argv: list[str], env: Mapping[str, str]) -> argparse.Namespace:
    """torchrun's parsed arguments for `elastic-runner launch ARGV` under ENV, the way the
    launcher parses them (torch.distributed.run.get_args_parser, PET_* variables included),
    without the launcher's own defaults, so that the manifests must spell them out."""
    from torch.distributed.run import get_args_parser

    with torchrun_environment(env):
        return get_args_parser().parse_args(launch_argv)


def torchrun_dests() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {a.dest for a in get_args_parser()._actions if a.option_strings}


def canonical_command(args: argparse.Namespace, program: list[str]) -> str:
    """One flag per non-default torchrun setting, in parser order: a readable form for messages."""
    from torch.distributed.run import get_args_parser

    with torchrun_environment({}):
        parser = get_args_parser()
    words = list(program)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value == parser.get_default(action.dest):
            continue
        flag = action.option_strings[0] if action.dest == "module" else "--" + action.dest
        words.append(flag if value is True else f"{flag}={value}")
    words += [args.training_script, *args.training_script_args]
    return " ".join(shlex.quote(w) if "$" not in w else w for w in words)


# -- metrics ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def exported_metric_names() -> frozenset[str]:
    """Every series name the workers (elastic_runner.observe.metrics) and the agents export."""
    from elastic_runner.observe.metrics import Metrics

    names = {s.name for family in Metrics(rank=0, local_rank=0).registry.collect() for s in family.samples}
    for name, kind in AGENT_METRICS.items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return frozenset(names)


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(elastic_runner_[A-Za-z0-9_]+)\b", expr))


# -- network policies --------------------------------------------------------------------------


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to ``labels``."""
    if selector is None:
        return False
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"selector fields {sorted(unknown)} are not modelled here: {selector}")
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass
class Peer:
    """A pod at one end of a connection: its labels, and its namespace (``None``: the job's)."""

    labels: dict[str, str]
    namespace: str | None = None

    @property
    def same_namespace(self) -> bool:
        return self.namespace is None

    @property
    def namespace_labels(self) -> dict[str, str]:
        """What Kubernetes labels every namespace with itself."""
        return {"kubernetes.io/metadata.name": self.namespace or "the-jobs-namespace"}


def _peer_matches(peer: Mapping[str, Any], other: Peer) -> bool:
    """One entry of a rule's ``from``/``to`` against a pod (pod traffic: an ipBlock is not judged here)."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        namespace_ok = peer["namespaceSelector"] == {} or _selects(peer["namespaceSelector"], other.namespace_labels)
    else:
        namespace_ok = other.same_namespace
    return namespace_ok and ("podSelector" not in peer or _selects(peer["podSelector"], other.labels))


def _port_matches(rule_ports: list[dict[str, Any]] | None, named: Mapping[str, int], port: int, protocol: str) -> bool:
    if rule_ports is None:
        return True
    return any(p.get("protocol", "TCP") == protocol
               and (named.get(p["port"], p["port"]) == port if isinstance(p["port"], str) else p["port"] == port)
               for p in rule_ports)


def egress_admits(docs: list[dict[str, Any]], source_labels: Mapping[str, str], target: Peer, port: int,
                  protocol: str = "TCP", target_ports: Mapping[str, int] | None = None) -> bool:
    """Whether the rendered NetworkPolicies let a pod labelled ``source_labels`` open a connection to ``target`` on
    ``port`` (a pod no Egress policy selects may reach anything; otherwise the union of the rules of those that do)."""
    policies = [p for p in by_kind(docs, "NetworkPolicy")
                if "Egress" in p["spec"].get("policyTypes", []) and _selects(p["spec"]["podSelector"], source_labels)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            if not _port_matches(rule.get("ports"), target_ports or {}, port, protocol):
                continue
            peers = rule.get("to")
            if not peers or any(_peer_matches(peer, target) for peer in peers):
                return True
    return False


def ingress_admits(docs: list[dict[str, Any]], target_labels: Mapping[str, str], target_ports: Mapping[str, int],
                   source: Peer, port: int) -> bool:
    """Whether the rendered NetworkPolicies let ``source`` reach a pod labelled ``target_labels`` on ``port``
    (Kubernetes semantics: a pod no Ingress policy selects admits everything; otherwise the union of the
    rules of every policy that selects it)."""
    policies = [p for p in by_kind(docs, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and _selects(p["spec"]["podSelector"], target_labels)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if not _port_matches(rule.get("ports"), target_ports, port, "TCP"):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False
