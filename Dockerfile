# syntax=docker/dockerfile:1
# The worker image of the Kubernetes manifests (k8s/): elastic_runner with torch
# 2.13.0, run as `tini -- elastic-runner ...` by a non-root user.
#
#   docker build -t elastic-runner:0.1.0-cpu .                          # k8s/overlays/cpu-dev
#   docker build --build-arg BASE=cuda -t elastic-runner:0.1.0-cuda12.8 .  # k8s/overlays/gpu
#
# BASE picks the base image and the matching torch build: `cpu` (Debian slim with
# Python, CPU torch wheels) or `cuda` (NVIDIA's CUDA base image, CUDA torch wheels;
# the GPU driver comes from the node through the NVIDIA container toolkit). Other
# CUDA versions: --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04
# --build-arg TORCH_CUDA=cu126 (and change the tag). The s3 and gcs extras are
# always installed (snapshot.dir in a bucket: k8s/overlays/object-storage);
# EXTRAS=vision adds torchvision (install the release that matches torch 2.13.0).
# tests/deploy/test_dockerfile.py checks that the overlays use the tags built above.

ARG BASE=cpu
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# --- CPU: Python from the official image, torch's CPU wheels --------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

# --- CUDA: NVIDIA's base image (driver capabilities, library paths), the
# distribution's Python, torch's CUDA wheels (they bring CUDA, cuDNN and NCCL) --
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_CUDA=cu128
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# --- The worker, on the base chosen by BASE --------------------------------------
FROM base-${BASE}
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv

# torch first, from the index of the chosen build (the package itself does not pin
# torch, so that pip keeps this one). Its own layer: it is by far the largest and
# changes least often.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# Then the package with the project's pinned dependencies (constraints-torch-2.13.txt
# pins torch to the same version, so pip keeps the build installed above), with the
# object-store clients: s3fs (S3 and S3-compatible services) and gcsfs.
WORKDIR /opt/elastic-runner
COPY pyproject.toml README.md constraints.txt constraints-torch-2.13.txt ./
COPY elastic_runner ./elastic_runner
RUN pip install -c constraints.txt -c constraints-torch-2.13.txt ".[s3,gcs${EXTRAS:+,$EXTRAS}]" \
 && python3 -c "import torch, elastic_runner, s3fs, gcsfs; print('elastic_runner', elastic_runner.__version__, 'torch', torch.__version__)"

# Non-root, with a numeric id so that Kubernetes' runAsNonRoot can verify it (the
# manifests run as 1000:1000 and give the run volume to group 1000). Ubuntu images
# already have a user 1000 ("ubuntu"): it makes way.
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)" 2>/dev/null || true; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 trainer \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin trainer
USER 1000:1000
WORKDIR /home/trainer

# tini is PID 1: it reaps orphaned processes and forwards SIGTERM to the torchrun
# agent (a Python PID 1 ignores SIGTERM until torchrun installs its handler).
ENTRYPOINT ["tini", "--", "elastic-runner"]
CMD ["--help"]
