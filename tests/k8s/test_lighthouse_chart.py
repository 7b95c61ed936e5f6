"""The chart runs the torchft Lighthouse: a sidecar container of the controller pod,
exposed on the controller Service, whose address every worker pod's trainer gets, so that
`kubectl scale` of the worker StatefulSet gives pods that train together. Offline (rendered
with the real helm binary); tests/k8s/test_rendered_pod.py starts the rendered Lighthouse and
asks it for a quorum at the trainer's address."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from podrl.config import ConfigError
from podrl.tools.render_k8s import HelmError, helm_template
from tests.k8s.local_pod import image_config, image_of
from tests.k8s.manifests import (
    NAMESPACE,
    RELEASE,
    container,
    env_map,
    find,
    render,
    worker_pod,
)

FIELDS = {"metadata.name": "p-0", "metadata.namespace": NAMESPACE, "status.podIP": "10.0.0.9"}
LIGHTHOUSE_ADDRESS = "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS"


def _fails(values: dict[str, Any]) -> str:
    with pytest.raises(HelmError) as err:
        helm_template(values)
    return err.value.stderr


def _controller_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment", f"{RELEASE}-controller")["spec"]["template"]["spec"]


def _service_ports(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    service = find(objects, "Service", f"{RELEASE}-controller")
    return {p["name"]: p for p in service["spec"]["ports"]}


def test_the_lighthouse_is_a_sidecar_of_the_controller_pod_from_the_trainer_image() -> None:
    objects = render({})
    pod = _controller_pod(objects)
    assert [c["name"] for c in pod["containers"]] == ["controller", "lighthouse"]
    lighthouse = container(pod, "lighthouse")
    # The controller image has no torch; torchft (and podrl-lighthouse) is in the trainer
    # image, whose CPU variant it runs by default on every GPU mode.
    assert lighthouse["image"] == "ghcr.io/podrl/podrl-trainer:0.1.0-cpu"
    assert lighthouse["command"] == ["podrl-lighthouse", "--config", "/etc/podrl/run.yaml"]
    dockerfile, build_args = image_of(lighthouse["image"])
    assert dockerfile == Path(dockerfile).parents[1] / "trainer" / "Dockerfile"
    assert any("[trainer]" in run for run in image_config(dockerfile, build_args).runs)
    cuda = container(
        _controller_pod(render({"controller": {"lighthouse": {"imageVariant": "cuda"}}})),
        "lighthouse",
    )
    assert cuda["image"] == "ghcr.io/podrl/podrl-trainer:0.1.0"
    # `kubectl logs deploy/podrl-controller` shows the controller, not the Lighthouse.
    annotations = find(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "controller"


def test_the_lighthouse_has_a_named_port_grpc_probes_resources_and_no_privileges() -> None:
    objects = render({})
    lighthouse = container(_controller_pod(objects), "lighthouse")
    assert lighthouse["ports"] == [
        {"name": "lighthouse", "containerPort": 29510, "protocol": "TCP"}
    ]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The front's gRPC health: torchft's status page is on loopback only.
        assert lighthouse[kind]["grpc"] == {
            "port": 29510,
            "service": "torchft.LighthouseService",
        }, kind
        assert "httpGet" not in lighthouse[kind], kind
    assert lighthouse["resources"]["requests"] == {"cpu": "100m", "memory": "512Mi"}
    assert lighthouse["resources"]["limits"] == {"memory": "1Gi"}
    assert (
        lighthouse["securityContext"]
        == container(_controller_pod(objects), "controller")["securityContext"]
    )
    assert lighthouse["securityContext"]["readOnlyRootFilesystem"] is True
    assert lighthouse["securityContext"]["runAsNonRoot"] is True
    # Only its /tmp is writable; it mounts the run config and the run secret (its front
    # checks the MAC in the trainers' replica ids), both read-only, as the controller does.
    mounts = {m["mountPath"]: m for m in lighthouse["volumeMounts"]}
    assert sorted(mounts) == ["/etc/podrl", "/tmp", "/var/run/secrets/podrl"]
    assert mounts["/etc/podrl"]["readOnly"] is True
    volumes = {v["name"]: v for v in _controller_pod(objects)["volumes"]}
    assert volumes[mounts["/tmp"]["name"]] == {"name": "tmp-lighthouse", "emptyDir": {}}
    controller = container(_controller_pod(objects), "controller")
    secret_mount = next(m for m in controller["volumeMounts"] if m["name"] == "run-secret")
    assert mounts["/var/run/secrets/podrl"] == secret_mount
    env = env_map(lighthouse, FIELDS)
    assert env["PODRL_RUN_SECRET_FILE"] == env_map(controller, FIELDS)["PODRL_RUN_SECRET_FILE"]
    assert env["HOME"] == "/tmp" and env["DO_NOT_TRACK"] == "1"


def test_torchfts_server_listens_on_loopback_and_the_front_on_the_service_port() -> None:
    """The Service port is podrl's authenticating front; torchft's own server (its status
    page, its kill endpoint) is bound to loopback, which the run config refuses to widen."""
    from podrl.config import load_config

    env = env_map(container(_controller_pod(render({})), "lighthouse"), FIELDS)
    assert env["PODRL_TRAINER__REPLICATION__LIGHTHOUSE_BIND"] == "0.0.0.0:29510"
    assert env["PODRL_TRAINER__REPLICATION__LIGHTHOUSE_SERVER_BIND"] == "127.0.0.1:0"
    settings = load_config(None, env).trainer.replication
    assert settings.lighthouse_server_bind == "127.0.0.1:0"
    assert settings.lighthouse_bind == "0.0.0.0:29510"
    wide = {**env, "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_SERVER_BIND": "0.0.0.0:1"}
    with pytest.raises(ConfigError, match=r"lighthouse_server_bind.*loopback only"):
        load_config(None, wide)


def test_the_controller_service_exposes_it_and_every_trainer_gets_its_address() -> None:
    objects = render({"workers": {"replicas": 3}})
    port = _service_ports(objects)["lighthouse"]
    assert (port["port"], port["targetPort"], port["protocol"]) == (29510, "lighthouse", "TCP")
    pod = worker_pod(objects)
    envs = {c["name"]: env_map(c, FIELDS) for c in pod["containers"]}
    address = f"{RELEASE}-controller.{NAMESPACE}.svc:29510"
    assert envs["trainer"][LIGHTHOUSE_ADDRESS] == address
    assert envs["trainer"]["PODRL_WORKER_ID"] == FIELDS["metadata.name"]  # one group per pod
    assert envs["trainer"]["PODRL_TRAINER__ADVERTISE_HOST"] == FIELDS["status.podIP"]
    assert [name for name, env in envs.items() if LIGHTHOUSE_ADDRESS in env] == ["trainer"]


def test_the_lighthouse_port_follows_the_run_configs_bind_address() -> None:
    values = {"runConfig": {"trainer": {"replication": {"lighthouse_bind": "[::]:7000"}}}}
    objects = render(values)
    lighthouse = container(_controller_pod(objects), "lighthouse")
    assert lighthouse["ports"][0]["containerPort"] == 7000
    assert env_map(lighthouse, FIELDS)["PODRL_TRAINER__REPLICATION__LIGHTHOUSE_BIND"] == (
        "0.0.0.0:7000"
    )
    assert _service_ports(objects)["lighthouse"]["port"] == 7000
    trainer = env_map(container(worker_pod(objects), "trainer"), FIELDS)
    assert trainer[LIGHTHOUSE_ADDRESS].endswith(".svc:7000")


@pytest.mark.parametrize("bind", ["[::]:0", "0.0.0.0", "[::]:70000"])
def test_a_lighthouse_bind_without_a_fixed_port_is_refused_with_the_field(bind: str) -> None:
    message = _fails({"runConfig": {"trainer": {"replication": {"lighthouse_bind": bind}}}})
    assert f"runConfig.trainer.replication.lighthouse_bind={bind}" in message
    assert "fixed port from 1 to 65535" in message


def test_a_lighthouse_address_in_the_run_config_is_refused() -> None:
    values = {"runConfig": {"trainer": {"replication": {"lighthouse_address": "elsewhere:1"}}}}
    message = _fails(values)
    assert "runConfig.trainer.replication.lighthouse_address is set by the chart" in message


def test_more_worker_pods_than_the_controller_trains_are_refused() -> None:
    message = _fails({"workers": {"replicas": 9}})
    assert "workers.replicas=9 is above runConfig.controller.max_worker_pods=8" in message
    render({"workers": {"replicas": 3}, "runConfig": {"controller": {"max_worker_pods": 3}}})


def test_with_one_pod_at_most_there_is_no_lighthouse() -> None:
    """max_worker_pods: 1, as `podrl up` with one pod at most: no Lighthouse, no address."""
    values = {
        "runConfig": {"controller": {"max_worker_pods": 1}},
        "networkPolicy": {"enabled": True},
    }
    objects = render(values)
    assert [c["name"] for c in _controller_pod(objects)["containers"]] == ["controller"]
    assert "tmp-lighthouse" not in {v["name"] for v in _controller_pod(objects)["volumes"]}
    assert "lighthouse" not in _service_ports(objects)
    trainer = env_map(container(worker_pod(objects), "trainer"), FIELDS)
    assert LIGHTHOUSE_ADDRESS not in trainer
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    peers = [
        rule
        for policy in policies
        for rule in policy["spec"]["ingress"]
        if any(
            peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            == "worker"
            for peer in rule.get("from", [])
        )
    ]
    assert [p["port"] for rule in peers for p in rule["ports"]] == [50050]  # Register only
    assert "workers.replicas=2 is above" in _fails({**values, "workers": {"replicas": 2}})


def test_torchfts_checkpoint_server_listens_on_an_ephemeral_port() -> None:
    """Why the worker NetworkPolicy opens every TCP port between worker pods (docs): the
    server a joining pod heals from takes a free port, a different one each time."""
    from torchft.checkpointing import HTTPTransport

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    transports = [HTTPTransport(timedelta(seconds=5), num_chunks=0) for _ in range(2)]
    try:
        ports = [t._server.socket.getsockname()[1] for t in transports]
        assert ports[0] != ports[1]
        assert all(low <= port <= high for port in ports), ports
        for port in ports:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # listening on every interface (IPv6 wildcard, IPv4 mapped)
    finally:
        for transport in transports:
            transport.shutdown()
