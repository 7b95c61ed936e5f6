"""Playing the rendered chart's pods in real containers with ``podman kube play``.

podman runs a Pod manifest as a real pod: one network namespace for its containers, init
containers first, emptyDir volumes shared between containers, the security context applied by
the runtime (user, read-only root filesystem, capabilities, no-new-privileges). What the
kubelet and the API server would add, and podman 4.3 lacks, is done here, each on the manifest
before it is played:

- ``valueFrom.fieldRef`` (``metadata.name``, ``metadata.namespace``, ``status.podIP``): the
  literal value; the pod gets a fixed IP on a test network (``--ip``), so its IP is known first.
- ``configMap`` and ``secret`` volumes (podman 4.3 crashes on secret volumes): ``hostPath``
  folders laid out as the kubelet's atomic writer does (``..data`` links), the files owned by
  group ``fsGroup`` with the volume's ``defaultMode``.
- ``emptyDir``: a podman volume per pod and volume (:func:`create_volume`); with ``medium:
  Memory`` a tmpfs with the kubelet's mode 0777 (podman's own emptyDir is a folder on disk,
  which a non-root user cannot write at ``/dev/shm``).
- Service names: ``hostAliases`` to the controller pod's IP (cluster DNS).
- ``ports``: dropped. podman 4.3 publishes every ``containerPort`` on the host (and fails on
  one in use there); in a cluster they only name ports, and the test reaches the pod IP.
- Probes: podman 4.3 does not run ``grpc:`` probes; :func:`probe` runs the same gRPC health
  check from the host against the pod IP, as the kubelet does from the node.
- Stopping: :func:`stop_pod` sends SIGTERM to each container's main process and stops the
  infra container last, as the kubelet stops the sandbox after the containers (``podman pod
  stop`` alone stops the infra container with them, and in a pod that shares its PID namespace
  the infra's exit kills every process there before it drains).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from podrl.tools.render_k8s import REPO_ROOT
from tests.k8s.local_pod import write_volume_files

PODMAN_CONF = REPO_ROOT / "docker" / "podman" / "containers.conf"
TMPFS_MODE = "0777"  # the kubelet's mode for every emptyDir


def podman_env() -> dict[str, str]:
    """The environment podman runs with: the repository's containers.conf unless one is set."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
    return env


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["podman", *args],
        env=podman_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return done


def missing_requirements(images: list[str]) -> str | None:
    """Why container pods cannot run here (None when they can)."""
    if shutil.which("podman") is None:
        return "no podman on this machine (apt-get install podman runc; docs/kubernetes.md)"
    done = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False, timeout=60)
    if done.returncode != 0:
        return f"podman does not run here: {done.stderr.strip()[-300:]}"
    absent = [i for i in images if podman("image", "exists", i, check=False).returncode != 0]
    if absent:
        return f"images {absent} not built (make images VARIANT=cpu)"
    return None


def _field(path: str, pod_name: str, namespace: str, pod_ip: str) -> str:
    values = {"metadata.name": pod_name, "metadata.namespace": namespace, "status.podIP": pod_ip}
    if path not in values:
        raise ValueError(f"fieldRef {path}: not emulated here")
    return values[path]


def pod_manifest(
    name: str,
    spec: Mapping[str, Any],
    objects: list[dict[str, Any]],
    *,
    namespace: str,
    pod_ip: str,
    hosts: Mapping[str, str],
    folder: Path,
    volume_prefix: str,
) -> tuple[dict[str, Any], dict[str, bool]]:
    """A playable Pod for the pod template ``spec`` (see the module docstring), and the podman
    volumes it needs created first (:func:`create_volume`): name -> memory-backed."""
    spec = copy.deepcopy(dict(spec))
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        container.pop("ports", None)
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("fieldRef")
            if ref:
                var.pop("valueFrom")
                var["value"] = _field(ref["fieldPath"], name, namespace, pod_ip)
    volumes: dict[str, bool] = {}
    for volume in spec.get("volumes", []):
        source = volume.get("configMap") or volume.get("secret")
        if source is not None:
            if "configMap" in volume:
                data = {
                    k: v.encode() for k, v in by_name[("ConfigMap", source["name"])]["data"].items()
                }
            else:
                secret = by_name[("Secret", source["secretName"])]
                data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
            if source.get("items"):
                data = {item["path"]: data[item["key"]] for item in source["items"]}
            target = folder / volume["name"]
            write_volume_files(target, data, source.get("defaultMode", 0o644))
            if fs_group is not None:  # the kubelet gives the files to fsGroup
                for path in target.rglob("*"):
                    os.lchown(path, -1, fs_group)
            volume.pop("configMap", None)
            volume.pop("secret", None)
            volume["hostPath"] = {"path": str(target), "type": "Directory"}
        elif "emptyDir" in volume:
            claim = f"{volume_prefix}-{name}-{volume['name']}"
            volumes[claim] = volume.pop("emptyDir").get("medium") == "Memory"
            volume["persistentVolumeClaim"] = {"claimName": claim}
    spec["hostAliases"] = [
        {"ip": ip, "hostnames": [host for host, to in hosts.items() if to == ip]}
        for ip in sorted(set(hosts.values()))
    ]
    # podman removes "once" init containers after they ran, and 4.3 fails doing so ("cannot
    # remove container ... as it is running"); "always" keeps them (and their exit code), but
    # podman then restarts them with the pod's restartPolicy: OnFailure runs the init container
    # once, as Kubernetes does, and still restarts a main container that fails.
    spec["restartPolicy"] = "OnFailure"
    annotations = {"io.podman.annotations.init.container.type": "always"}
    metadata = {"name": name, "annotations": annotations}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
    return pod, volumes


def create_volume(name: str, memory: bool, image: str) -> None:
    """An emptyDir's volume, one per pod: podman 4.3 names an emptyDir's volume after the
    volume alone, so pods (and test runs) would share ``run-state`` or ``tmp``. A
    memory-backed one is a tmpfs with the kubelet's mode; its first mount in a throwaway
    container uses up podman's copy-up, which would otherwise give it the image's ``/dev/shm``
    (root, 0755)."""
    podman("volume", "rm", "-f", name, check=False)
    if not memory:
        podman("volume", "create", name)
        return
    podman(
        "volume", "create", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
        "--opt", f"o=mode={TMPFS_MODE},nosuid,nodev", name,
    )  # fmt: skip
    podman("run", "--rm", "--entrypoint", "true", "-v", f"{name}:/podrl-copy-up", image)


def play(pod: dict[str, Any], path: Path, network: str, ip: str) -> None:
    path.write_text(yaml.safe_dump(pod, sort_keys=False))
    podman("kube", "play", "--network", network, "--ip", ip, str(path))


def stop_pod(pod: str, containers: list[str], grace: int) -> None:
    """Stop ``pod`` as the kubelet does: SIGTERM to the main process of each of its
    ``containers``, SIGKILL to what outlives ``grace`` seconds, then the pod's own infra
    container. Not ``podman stop``: in a pod that shares its PID namespace, podman 4.3 signals
    every process of the namespace for each container it stops, so a service that drained got
    a second signal, or a SIGKILL, from its neighbours' stops."""
    podman("kill", "--signal", "TERM", *containers)
    try:
        podman("wait", *containers, timeout=grace)
    except subprocess.TimeoutExpired:
        podman("kill", "--signal", "KILL", *containers, check=False)
    podman("pod", "stop", "-t", str(grace), pod, timeout=grace + 60)


def inspect(container: str) -> dict[str, Any]:
    return json.loads(podman("inspect", "--type", "container", container).stdout)[0]


def logs(container: str, lines: int = 60) -> str:
    done = podman("logs", "--tail", str(lines), container, check=False)
    return done.stdout + done.stderr
