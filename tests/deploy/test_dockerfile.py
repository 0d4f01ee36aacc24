"""The container image (Dockerfile), checked offline: one file for CPU and CUDA images, torch installed
first and then the pinned package, the manifests' user and images, and a build context that holds what
the Dockerfile copies."""

from __future__ import annotations

import re

from .k8s_support import (
    K8S,
    OVERLAYS,
    ROOT,
    dockerfile_entrypoint,
    dockerfile_instructions,
    render,
    worker_pods,
)

# -- the image -------------------------------------------------------------------------------------


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def test_the_dockerfile_builds_cpu_and_cuda_images_from_one_file() -> None:
    instructions = dockerfile_instructions()
    first_from = next(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    global_args = {args.split("=")[0]: args.partition("=")[2] for word, args in instructions[:first_from] if word == "ARG"}
    assert global_args.get("BASE") == "cpu", "BASE selects the base image; CPU by default"
    stages = {args.split()[-1]: args.split()[0] for word, args in instructions if word == "FROM" and " AS " in args.upper()}
    assert {"base-cpu", "base-cuda"} <= stages.keys()
    assert "CUDA_IMAGE" in stages["base-cuda"] and "nvidia/cuda" in global_args["CUDA_IMAGE"]
    assert final_stage()[0] == ("FROM", "base-${BASE}")
    cuda_stage = [args for word, args in instructions if word in ("ARG", "ENV")]
    assert any("whl/${TORCH_CUDA}" in a for a in cuda_stage) and any("whl/cpu" in a for a in cuda_stage)


def test_the_dockerfile_installs_torch_first_then_the_pinned_package() -> None:
    runs = [args for word, args in final_stage() if word == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r and "--index-url" in r)
    package_step = next(i for i, r in enumerate(runs) if "-c constraints.txt" in r)
    assert torch_step < package_step, "torch must come from the chosen index before pip resolves the package"
    version = next(args.split("=")[1] for word, args in final_stage() if word == "ARG" and args.startswith("TORCH_VERSION="))
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints-torch-2.13.txt").read_text(), re.M)
    assert pin and pin.group(1) == version, "the image's torch is the version constraints-torch-2.13.txt pins"


def test_the_image_can_keep_snapshots_in_object_storage() -> None:
    """snapshot.dir: s3://... or gs://... (k8s/overlays/object-storage) needs s3fs or gcsfs in the image: the package
    is installed with the s3 and gcs extras whatever EXTRAS adds, and the build fails if either does not import."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"s3", "gcs"} <= extras.keys()
    package_step = next(args for word, args in final_stage() if word == "RUN" and "-c constraints.txt" in args)
    requirement = re.search(r'"\.\[([^\]"]*)\]"', package_step)
    assert requirement, f"the package is installed without extras: {package_step}"
    assert requirement.group(1).startswith("s3,gcs"), f"installs .[{requirement.group(1)}]"
    assert requirement.group(1).removeprefix("s3,gcs") in ("", "${EXTRAS:+,$EXTRAS}"), "EXTRAS adds to s3,gcs"
    assert re.search(r"import [^;\"]*\bs3fs\b", package_step) and re.search(r"import [^;\"]*\bgcsfs\b", package_step)


def test_the_image_runs_elastic_runner_as_the_manifests_user(kubectl: str) -> None:
    user = [args for word, args in final_stage() if word == "USER"]
    assert user and re.fullmatch(r"\d+:\d+", user[-1]), "a numeric user: runAsNonRoot can only verify numbers"
    uid, gid = (int(x) for x in user[-1].split(":"))
    assert uid != 0
    entrypoint = dockerfile_entrypoint()
    assert entrypoint[:2] == ["tini", "--"] and entrypoint[-1] == "elastic-runner"
    for name in OVERLAYS:
        for pod in worker_pods(render(kubectl, K8S / "overlays" / name)):
            context = pod.spec["securityContext"]
            assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid), name


def test_the_overlays_use_the_images_the_dockerfile_documents(kubectl: str) -> None:
    header = (ROOT / "Dockerfile").read_text()
    builds = {m.group(2): m.group(1) for m in re.finditer(r"^#\s+docker build (.*?)-t (\S+) \.", header, re.M)}
    assert builds, "the Dockerfile's header documents its build commands"
    for name in OVERLAYS:
        for pod in worker_pods(render(kubectl, K8S / "overlays" / name)):
            image = pod.container()["image"]
            assert image in builds, f"{name} uses {image}; the Dockerfile builds {sorted(builds)}"
            cuda = "BASE=cuda" in builds[image]
            assert cuda == ("nvidia.com/gpu" in pod.container()["resources"].get("limits", {})), (
                f"{name}: {image} is {'a CUDA' if cuda else 'a CPU'} image")


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "an allow-list: only what is listed reaches the build"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = [src for word, args in dockerfile_instructions() if word == "COPY" for src in args.split()[:-1]
              if not src.startswith("--")]
    assert copied
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"
    assert "README.md" in allowed, "pyproject.toml's readme must be in the build context"
