"""The chart over its values matrix: GPU mode (DRA, device plugin) x 0/1/4 workers x expandable
segments on/off x Kubernetes 1.34/1.35/1.37, with the real helm binary and the official schemas.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from podrl.common.service import worker_spec
from podrl.config import RunConfig, load_config
from podrl.controller.service.main import build_spec
from podrl.tools.render_k8s import helm_lint
from tests.k8s.manifests import (
    GPU_CONTAINERS,
    MATRIX,
    NAMESPACE,
    RELEASE,
    Case,
    container,
    env_map,
    find,
    pod_specs,
    render,
    validation_error,
    worker_pod,
)
from tests.k8s.pod_security import baseline_violations, restricted_violations

CASES = pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])


def _objects(case: Case) -> list[dict]:
    return render(case.values, case.kube_version)


@CASES
def test_helm_lint_strict(case: Case) -> None:
    out = helm_lint(case.values, kube_version=case.kube_version)
    assert "0 chart(s) failed" in out


@CASES
def test_every_object_passes_strict_schema_validation(case: Case) -> None:
    objects = _objects(case)
    expected = {
        "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
        "PersistentVolumeClaim", "StatefulSet", "PodDisruptionBudget", "Pod", "Secret",
        "NetworkPolicy",  # only the run's worker pods reach the Lighthouse (on by default)
    }  # fmt: skip
    if case.gpu_mode == "dra":
        expected.add("ResourceClaimTemplate")
    assert {o["kind"] for o in objects} == expected
    for obj in objects:
        error = validation_error(obj, case.kube_version)
        assert error is None, f"{obj['kind']}/{obj['metadata']['name']}: {error}"


@CASES
def test_gpu_containers_share_one_claim_and_one_memory_shm(case: Case) -> None:
    objects = _objects(case)
    pod = worker_pod(objects)
    assert [c["name"] for c in pod["containers"]] == list(GPU_CONTAINERS)
    assert pod["shareProcessNamespace"] is True

    shm_volumes = {
        m["name"]
        for c in pod["containers"]
        for m in c["volumeMounts"]
        if m["mountPath"] == "/dev/shm"
    }
    assert len(shm_volumes) == 1, shm_volumes
    for c in pod["containers"]:
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"]), c["name"]
    (shm,) = [v for v in pod["volumes"] if v["name"] in shm_volumes]
    assert shm["emptyDir"]["medium"] == "Memory"

    if case.gpu_mode == "dra":
        (claim,) = pod["resourceClaims"]
        template = find(objects, "ResourceClaimTemplate")
        assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
        assert template["apiVersion"] == "resource.k8s.io/v1"
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["count"] == 1
        for c in pod["containers"]:
            assert c["resources"]["claims"] == [{"name": claim["name"]}], c["name"]
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    else:
        assert "resourceClaims" not in pod
        requesting = [c for c in pod["containers"] if "nvidia.com/gpu" in c["resources"]["limits"]]
        assert [c["name"] for c in requesting] == ["trainer"]
        assert requesting[0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        for c in pod["containers"]:
            env = env_map(c, {"metadata.name": "x", "metadata.namespace": "x", "status.podIP": "x"})
            assert ("NVIDIA_VISIBLE_DEVICES" in env) == (c["name"] != "trainer"), c["name"]
        # "all" devices is only the pod's devices when the pod is alone on its node.
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


def _registered_service_names() -> dict[str, str]:
    """The grpc.health service name each service process sets SERVING (from podrl's own code)."""
    config = RunConfig()
    names = {"controller": build_spec(config).grpc_service}
    for name in GPU_CONTAINERS:
        spec = worker_spec(name, config, object(), lambda servicer, server: None)
        names[name] = spec.grpc_service
    return names


@CASES
def test_probes_are_native_grpc_with_the_service_names_the_services_register(case: Case) -> None:
    objects = _objects(case)
    registered = _registered_service_names()
    defaults = RunConfig()
    pods = {
        "controller": find(objects, "Deployment")["spec"]["template"]["spec"],
        "worker": worker_pod(objects),
    }
    for pod_name, pod in pods.items():
        for c in pod["containers"]:
            if c["name"] == "lighthouse":
                continue  # not gRPC health: tests/k8s/test_lighthouse_chart.py
            port = getattr(defaults, c["name"]).grpc_port
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert port in named.values(), (pod_name, c["name"], named)
            for probe_kind in ("startupProbe", "readinessProbe"):
                probe = c[probe_kind]["grpc"]
                assert probe == {"port": port, "service": registered[c["name"]]}
            if c["name"] != "controller":
                assert c["livenessProbe"]["grpc"]["service"] == registered[c["name"]]
    assert registered == {
        "controller": "podrl.v1.Controller",
        "trainer": "podrl.v1.Trainer",
        "generator": "podrl.v1.Generator",
        "grader": "podrl.v1.Grader",
    }


@CASES
def test_selectors_match_pod_labels_and_services_reach_named_ports(case: Case) -> None:
    objects = _objects(case)
    workloads = {
        o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
    }
    pods = {name: w["spec"]["template"] for name, w in workloads.items()}
    for name, workload in workloads.items():
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = pods[name]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name

    def selected(selector: dict) -> set[str]:
        return {n for n, p in pods.items() if selector.items() <= p["metadata"]["labels"].items()}

    sts = find(objects, "StatefulSet")
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == case.workers
    headless = find(objects, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    for service in (o for o in objects if o["kind"] == "Service"):
        targets = selected(service["spec"]["selector"])
        assert len(targets) == 1, (service["metadata"]["name"], targets)
        (target,) = targets
        port_names = {p["name"] for c in pods[target]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)
    assert selected(find(objects, "Service", f"{RELEASE}-controller")["spec"]["selector"]) == {
        f"{RELEASE}-controller"
    }
    pdb = find(objects, "PodDisruptionBudget")
    assert selected(pdb["spec"]["selector"]["matchLabels"]) == {f"{RELEASE}-worker"}


@CASES
def test_every_object_has_the_standard_labels(case: Case) -> None:
    for obj in _objects(case):
        labels = obj["metadata"]["labels"]
        for key in ("name", "instance", "version", "component", "part-of", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, (obj["kind"], key)
        assert labels["app.kubernetes.io/instance"] == RELEASE


@CASES
def test_rbac_is_namespaced_and_minimal(case: Case) -> None:
    objects = _objects(case)
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(objects, "Role")
    rules = {
        (group, resource): (sorted(rule["verbs"]), rule.get("resourceNames"))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    read = (["get", "list", "watch"], None)
    assert rules == {
        ("", "pods"): (["list", "watch"], None),
        ("apps", "statefulsets"): read,
        ("apps", "statefulsets/scale"): (["patch"], [f"{RELEASE}-worker"]),
    }
    binding = find(objects, "RoleBinding")
    deployment = find(objects, "Deployment")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": deployment["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": NAMESPACE,
        }
    ]
    # Only the controller may talk to the API server.
    for name, pod in pod_specs(objects):
        assert pod["automountServiceAccountToken"] is (name == f"{RELEASE}-controller"), name


@CASES
def test_no_host_namespaces_and_pod_security(case: Case) -> None:
    objects = _objects(case)
    for name, pod in pod_specs(objects):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(key), (name, key)
        assert pod["enableServiceLinks"] is False, name  # PODRL_*-looking service env vars
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (name, c["name"])

    pod = worker_pod(objects)
    with_ptrace = {
        c["name"]
        for c in pod["containers"]
        if "SYS_PTRACE" in c["securityContext"]["capabilities"].get("add", [])
    }
    trainer_env = env_map(
        container(pod, "trainer"),
        {"metadata.name": "p", "metadata.namespace": "n", "status.podIP": "1.2.3.4"},
    )
    if case.expandable_segments:
        assert with_ptrace == {"generator"}
        assert trainer_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert any("SYS_PTRACE" in v for v in baseline_violations(pod))
    else:
        assert with_ptrace == set()
        assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_env
        for name, spec in pod_specs(objects):
            assert baseline_violations(spec) == [], name
            assert restricted_violations(spec) == [], name


@CASES
def test_helm_test_pod_checks_grpc_health_of_every_service(case: Case) -> None:
    objects = _objects(case)
    test_pod = find(objects, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = test_pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "podrl.tools.check_health"]
    targets = [arg for arg in command[3:] if "=" in arg]
    expected = [f"{RELEASE}-controller.{NAMESPACE}.svc:50050=podrl.v1.Controller"]
    if case.workers:
        expected += [
            f"all:{RELEASE}-worker.{NAMESPACE}.svc:50053=podrl.v1.Trainer",
            f"all:{RELEASE}-worker.{NAMESPACE}.svc:50051=podrl.v1.Generator",
            f"all:{RELEASE}-worker.{NAMESPACE}.svc:50052=podrl.v1.Grader",
        ]
    assert targets == expected


def _mount_of(c: dict, path: Path) -> dict | None:
    """The volume mount of container ``c`` that holds ``path`` (the deepest), if any."""
    holding = [
        m
        for m in c["volumeMounts"]
        if path == Path(m["mountPath"]) or Path(m["mountPath"]) in path.parents
    ]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


@pytest.mark.parametrize("gpu_mode", ["dra", "devicePlugin", "none"])
def test_each_container_loads_the_rendered_run_config(gpu_mode: str, tmp_path: Path) -> None:
    """The ConfigMap plus each container's PODRL_* variables pass podrl's own config loader,
    and every folder a container writes (run_dir, HOME) lies on one of its writable mounts,
    every folder it reads (the model) on one of its mounts: the root filesystem is read-only."""
    objects = render({"gpu": {"mode": gpu_mode}})
    config_map = find(objects, "ConfigMap")
    (config_file,) = config_map["data"]
    path = tmp_path / config_file
    path.write_text(config_map["data"][config_file])
    controller_service = find(objects, "Service", f"{RELEASE}-controller")
    controller_grpc = {p["name"]: p["port"] for p in controller_service["spec"]["ports"]}["grpc"]
    pods = {
        "podrl-controller-5d9f7": find(objects, "Deployment")["spec"]["template"]["spec"],
        "podrl-worker-0": worker_pod(objects),
    }
    lighthouse_port = {p["name"]: p["port"] for p in controller_service["spec"]["ports"]}[
        "lighthouse"
    ]
    for pod_name, pod in pods.items():
        mounts = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            assert c["command"][-2:] == ["--config", f"/etc/podrl/{config_file}"]
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/podrl"]
            assert mounts[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
            env = env_map(
                c,
                {
                    "metadata.name": pod_name,
                    "metadata.namespace": NAMESPACE,
                    "status.podIP": "10.1.2.3",
                },
            )
            config = load_config(path, env)
            replication = config.trainer.replication
            if c["name"] == "lighthouse":  # podrl-lighthouse reads trainer.replication
                assert replication.lighthouse_bind == f"0.0.0.0:{lighthouse_port}"
                writes = [Path(env["HOME"]), Path(env["XDG_CACHE_HOME"])]
                assert all(_mount_of(c, f) and not _mount_of(c, f).get("readOnly") for f in writes)
                continue
            # Every worker pod's trainer is a replica group at the controller Service's port.
            expected = f"{RELEASE}-controller.{NAMESPACE}.svc:{lighthouse_port}"
            assert replication.enabled is (c["name"] == "trainer"), c["name"]
            if c["name"] == "trainer":
                assert replication.lighthouse_address == expected
                assert config.worker_id == pod_name  # the replica id: one group per pod
            section = getattr(config, c["name"])
            assert config.worker_id == pod_name
            assert section.bind_host == "0.0.0.0"
            assert config.controller.address == (
                f"{RELEASE}-controller.{NAMESPACE}.svc:{controller_grpc}"
            )
            if c["name"] != "controller":
                assert section.address == f"10.1.2.3:{section.grpc_port}"
            assert str(config.run_dir).startswith("/var/lib/podrl/")
            writes = [Path(env["HOME"]), Path(env["XDG_CACHE_HOME"])]
            if c["name"] in ("controller", "trainer"):
                writes.append(config.run_dir)
            for folder in writes:
                mount = _mount_of(c, folder)
                assert mount is not None and not mount.get("readOnly"), (c["name"], folder)
            if c["name"] in ("trainer", "generator"):
                assert section.model_path == Path("/models")
                mount = _mount_of(c, section.model_path)
                assert mount is not None and mount["readOnly"] is True, c["name"]
                assert mounts[mount["name"]] == mounts["model"]


def test_ports_follow_the_run_config() -> None:
    objects = render({"runConfig": {"generator": {"grpc_port": 6000, "metrics_port": 0}}})
    generator = container(worker_pod(objects), "generator")
    assert [p["containerPort"] for p in generator["ports"]] == [6000]
    assert generator["readinessProbe"]["grpc"]["port"] == 6000
    headless = find(objects, "Service", f"{RELEASE}-worker")
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]}["generator-grpc"] == 6000
    assert "generator-prom" not in {p["name"] for p in headless["spec"]["ports"]}


def test_dra_mode_on_kubernetes_before_1_34_fails_with_the_fix() -> None:
    from podrl.tools.render_k8s import HelmError

    with pytest.raises(HelmError) as err:
        render({"gpu": {"mode": "dra"}}, kube_version="1.33.0")
    assert "gpu.mode=dra needs Kubernetes >= 1.34" in err.value.stderr
    assert "set gpu.mode=devicePlugin" in err.value.stderr
    # The fallback renders and validates on that version.
    for obj in render({"gpu": {"mode": "devicePlugin"}}, kube_version="1.33.0"):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_dra_claim_carries_count_and_selectors() -> None:
    selector = 'device.attributes["gpu.nvidia.com"].productName.matches("H200")'
    objects = render(
        {
            "gpu": {"count": 4, "dra": {"selectors": [selector]}},
            "runConfig": {"trainer": {"dp_shard": 4}},
        }
    )
    (request,) = find(objects, "ResourceClaimTemplate")["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 4
    assert request["exactly"]["selectors"] == [{"cel": {"expression": selector}}]


def test_cpu_mode_has_no_gpu_resources_and_cpu_images() -> None:
    objects = render({"gpu": {"mode": "none"}, "images": {"variant": "cpu"}})
    pod = worker_pod(objects)
    assert "resourceClaims" not in pod
    for c in pod["containers"]:
        assert "claims" not in c["resources"]
        assert not any(k.startswith("nvidia.com/") for k in c["resources"].get("limits", {}))
    images = {c["name"]: c["image"] for c in pod["containers"]}
    assert images == {
        "trainer": "ghcr.io/podrl/podrl-trainer:0.1.0-cpu",
        "generator": "ghcr.io/podrl/podrl-generator:0.1.0-cpu",
        "grader": "ghcr.io/podrl/podrl-grader:0.1.0",
    }


def test_long_release_name_is_refused_with_the_fix() -> None:
    from podrl.tools.render_k8s import HelmError

    with pytest.raises(HelmError) as err:
        from podrl.tools.render_k8s import helm_template

        helm_template(release="r" * 41)
    assert "needs at most 40" in err.value.stderr
    assert "fullnameOverride" in err.value.stderr
