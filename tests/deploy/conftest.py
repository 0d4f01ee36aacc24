"""Fixtures of the deployment checks: kubectl and promtool (skipped with the reason when missing), every
overlay rendered once per module, and the schemas the documents are validated against."""

from __future__ import annotations

from typing import Any

import pytest

from .k8s_support import (
    K8S,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    Schemas,
    find_kubectl,
    find_promtool,
    render,
)


@pytest.fixture(scope="module")
def kubectl() -> str:
    binary, why = find_kubectl()
    if binary is None:
        pytest.skip(why)
    return binary


@pytest.fixture(scope="module")
def promtool() -> str:
    binary, why = find_promtool()
    if binary is None:
        pytest.skip(why)
    return binary


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, kubectl: str) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(kubectl, K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def schemas() -> dict[str, Schemas]:
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) is not installed")
    return {version: Schemas(version) for version in KUBERNETES_VERSIONS}

