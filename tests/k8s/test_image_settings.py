"""A wrong image setting gives the error docs/kubernetes.md's troubleshooting table quotes:
a tag that no registry holds stops ``podman kube play`` in seconds, before any container
starts; a UID other than the images' 10001 cannot write the state folder the image gives to
10001. Seconds each, with the built controller image (``make images VARIANT=cpu``); skipped,
saying why, without podman or the image."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import yaml

from podrl.tools.render_k8s import VARIANTS
from tests.k8s.manifests import find, render
from tests.k8s.podman_pod import missing_requirements, podman

pytestmark = pytest.mark.containers


def _controller_image() -> str:
    """The controller image the CPU chart names (the smallest of the four)."""
    cpu = next(v for v in VARIANTS if v.filename == "podrl-cpu.yaml")
    objects = render(cpu.chart_values, skip_tests=True)
    (container,) = [
        c
        for c in find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "controller"
    ]
    return container["image"]


@pytest.fixture(scope="module")
def image() -> str:
    image = _controller_image()
    missing = missing_requirements([image])
    if missing:
        pytest.skip(missing)
    return image


def test_a_tag_no_registry_holds_stops_kube_play_before_any_container(
    image: str, tmp_path: Path
) -> None:
    wrong = f"{image.rpartition(':')[0]}:0.0.0-no-such-tag"
    name = f"podrl-test-tag-{secrets.token_hex(3)}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "controller", "image": wrong}]},
    }
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    started = time.monotonic()
    try:
        done = podman("kube", "play", str(path), check=False, timeout=120)
        took = time.monotonic() - started
        # podman 4.3 leaves the pod behind ("Created"), with no container in it.
        containers = podman(
            "ps", "-a", "--filter", f"pod={name}", "--format", "{{.Names}}", check=False
        ).stdout.split()
    finally:
        podman("pod", "rm", "-f", name, check=False)
    assert done.returncode != 0, done.stdout
    assert f"Trying to pull {wrong}" in done.stdout + done.stderr
    # No registry here ("no such host"), or one without the tag ("manifest unknown").
    assert f"Error: initializing source docker://{wrong}" in done.stderr, done.stderr
    assert took < 60, took
    assert [c for c in containers if not c.endswith("-infra")] == []


@pytest.mark.parametrize(("uid", "writes"), [(10001, True), (4242, False)])
def test_only_the_images_uid_writes_the_state_folder(image: str, uid: int, writes: bool) -> None:
    """The chart's runAsUser is the images' 10001; another UID starts but cannot write the
    folder the image gives to 10001 (what an emptyDir or a volume without fsGroup shows)."""
    done = podman(
        "run", "--rm", "--user", f"{uid}:{uid}", "--entrypoint", "touch", image,
        "/var/lib/podrl/written",
        check=False, timeout=120,
    )  # fmt: skip
    if writes:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0
        assert "touch: cannot touch '/var/lib/podrl/written': Permission denied" in done.stderr
