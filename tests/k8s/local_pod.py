"""Run a rendered pod's containers as local processes, as close to a kubelet as a test gets
without a container engine.

What each container gets, and how it is emulated here:

- **Its image's command.** ``command``/``args`` follow the kubelet's rules over the image's
  ENTRYPOINT/CMD (read from ``docker/<service>/Dockerfile``, final stage of the image's
  variant); ``$(VAR)`` references are expanded. Executables are found in this virtualenv,
  which holds what the images install.
- **Its environment.** The image's ENV, then the container's ``env`` in order (``fieldRef``
  from the pod's name, namespace and IP; ``secretKeyRef``/``configMapKeyRef`` from the
  rendered objects). ``PATH`` points at this virtualenv. Nothing of the test's own
  environment leaks in.
- **Its filesystem.** Each container has a root folder standing for its root filesystem. It is
  made read-only (chmod) once its mounts are in place, so a write anywhere but a writable
  mount fails, as under ``readOnlyRootFilesystem``. Each volume mount is a symlink in that
  root to the volume's folder; read-only mounts, and configMap and secret volumes (the
  kubelet always mounts those read-only), are made read-only too. The files of configMap and
  secret volumes are laid out as the kubelet's atomic writer does (each name a symlink to
  ``..data/<name>``, with the volume's ``defaultMode``): :func:`write_volume_files`. Every
  absolute path in the container's args, env values and configMap files is prefixed with its
  root, since there is no mount namespace to put the folders at the manifest's paths; the
  working directory (the image's WORKDIR) and the default HOME lie in the read-only root.
  ``/dev/shm`` mounts are the machine's ``/dev/shm`` (POSIX shared memory has no other place).
- **Its privileges.** Run by root (as here), the processes get an empty capability bounding
  set and no_new_privs, as with ``capabilities: {drop: [ALL]}`` and
  ``allowPrivilegeEscalation: false``, so the read-only folders bind root as well.
- **Its network.** Containers share the machine's loopback like a pod's containers share
  the pod's network namespace: the pod IP is 127.0.0.1; host names the caller maps (the
  controller Service) resolve to loopback by rewriting env values, args and config files,
  and so do ``host:port`` values naming such a host, whose port is mapped too (a Service
  port that leads to a remapped container port); ports the caller maps are used instead of
  the manifest's wherever a probe names them (the caller also gives the processes the
  overrides that make them listen there).

Init containers run one after the other to completion before the other containers start.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from podrl.cli.probes import grpc_health
from podrl.tools.render_k8s import REPO_ROOT

VENV_BIN = Path(sys.executable).parent
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodError(RuntimeError):
    """A container could not be started, exited, or never became ready."""


# ---- images ---------------------------------------------------------------------------------


@dataclass
class ImageConfig:
    """What an image's Dockerfile sets for its containers."""

    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    runs: list[str] = field(default_factory=list)
    """The RUN commands that built it, base stages first."""


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _substitute(text: str, args: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], ""), text)


def _env_pairs(text: str) -> dict[str, str]:
    """``ENV A=1 B="x y"`` (the key=value form)."""
    import shlex

    pairs = {}
    for token in shlex.split(text):
        key, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"ENV {text!r}: only the KEY=VALUE form is supported")
        pairs[key] = value
    return pairs


def image_config(dockerfile: Path, build_args: Mapping[str, str]) -> ImageConfig:
    """The config of the image ``dockerfile`` builds with ``build_args``: its final stage,
    following ``FROM <stage>`` back through the stages it is built on."""
    args: dict[str, str] = {}
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    order: list[str] = []
    current: list[tuple[str, str]] | None = None
    for keyword, rest in dockerfile_instructions(dockerfile.read_text()):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            if current is None:  # global ARG: usable in FROM lines
                args[name] = build_args.get(name, default)
            else:
                current.append((keyword, rest))
            continue
        if keyword == "FROM":
            words = _substitute(rest, args).split()
            base = words[0]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(order))
            current = []
            stages[name] = (base, current)
            order.append(name)
            continue
        if current is not None:
            current.append((keyword, rest))

    def resolve(stage: str) -> ImageConfig:
        base, instructions = stages[stage]
        config = resolve(base) if base in stages else ImageConfig()
        stage_args = dict(args)
        for keyword, rest in instructions:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                stage_args[name] = build_args.get(name, args.get(name, default))
            elif keyword == "ENV":
                config.env.update(_env_pairs(_substitute(rest, stage_args)))
            elif keyword == "WORKDIR":
                config.workdir = str(Path(config.workdir) / _substitute(rest, stage_args))
            elif keyword == "USER":
                config.user = rest
            elif keyword == "RUN":
                config.runs.append(_substitute(rest, stage_args))
            elif keyword == "ENTRYPOINT":
                config.entrypoint = json.loads(rest)
                config.cmd = []  # a new ENTRYPOINT resets an inherited CMD
            elif keyword == "CMD":
                config.cmd = json.loads(rest)
        return config

    return resolve(order[-1])


def image_of(reference: str) -> tuple[Path, dict[str, str]]:
    """Dockerfile and build args of a podrl image reference (``.../podrl-<service>:<tag>``)."""
    name, _, tag = reference.rpartition("/")[2].partition(":")
    service = name.removeprefix("podrl-")
    dockerfile = REPO_ROOT / "docker" / service / "Dockerfile"
    if not dockerfile.is_file():
        raise PodError(f"image {reference}: no {dockerfile.relative_to(REPO_ROOT)}")
    return dockerfile, {"VARIANT": "cpu" if tag.endswith("-cpu") else "cuda"}


# ---- processes ------------------------------------------------------------------------------


def _contained() -> None:
    """``preexec_fn``: die with the test; as root, no capabilities and no new privileges."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.geteuid() == 0:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"cannot drop capability {cap}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot set no_new_privs")


def run_contained(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` with the containers' privileges (see :func:`_contained`)."""
    return subprocess.run(argv, preexec_fn=_contained, text=True, **kwargs)


def make_read_only(path: Path) -> None:
    """Remove every write bit below ``path`` (symlinks are not followed)."""
    for folder, dirs, files in os.walk(path):
        for name in files:
            target = Path(folder) / name
            if not target.is_symlink():
                target.chmod(stat.S_IMODE(target.lstat().st_mode) & ~0o222)
        Path(folder).chmod(stat.S_IMODE(Path(folder).lstat().st_mode) & ~0o222)
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_symlink()]


def make_writable(path: Path) -> None:
    """Undo make_read_only (so the test can delete its folders)."""
    for folder, dirs, files in os.walk(path):
        Path(folder).chmod(stat.S_IMODE(Path(folder).lstat().st_mode) | 0o700)
        for name in files:
            target = Path(folder) / name
            if not target.is_symlink():
                target.chmod(stat.S_IMODE(target.lstat().st_mode) | 0o600)
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_symlink()]


def write_volume_files(folder: Path, files: Mapping[str, bytes], mode: int) -> None:
    """Lay ``files`` out in ``folder`` as the kubelet's atomic writer does for configMap,
    secret and projected volumes: the files in a hidden version folder ``..<timestamp>``,
    ``..data`` a symlink to it, and each top-level name a symlink ``<name> -> ..data/<name>``
    (a service that checks its secret file sees what it sees in a cluster)."""
    version = folder / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{os.getpid()}"
    version.mkdir(parents=True)
    for relative, content in files.items():
        target = version / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    (folder / "..data").symlink_to(version.name)
    for name in sorted({Path(relative).parts[0] for relative in files}):
        (folder / name).symlink_to(f"..data/{name}")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


# ---- the pod --------------------------------------------------------------------------------


@dataclass
class LocalContainer:
    """One container of a LocalPod."""

    name: str
    spec: dict[str, Any]
    init: bool
    root: Path
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def path(self, container_path: str) -> Path:
        """Where ``container_path`` (as the container sees it) lies on this machine."""
        return Path(str(self.root) + container_path)


class LocalPod:
    """A pod spec's containers as local processes (see the module docstring)."""

    def __init__(
        self,
        pod_name: str,
        pod_spec: dict[str, Any],
        objects: list[dict[str, Any]],
        base_dir: Path,
        *,
        namespace: str,
        hosts: Mapping[str, str] | None = None,
        port_map: Mapping[int, int] | None = None,
        extra_env: Mapping[str, str] | None = None,
        claim_templates: tuple[str, ...] = (),
        volume_dirs: Mapping[str, Path] | None = None,
    ) -> None:
        self.pod_name = pod_name
        self.spec = pod_spec
        self.namespace = namespace
        self.hosts = dict(hosts or {})
        self.port_map = dict(port_map or {})
        self.extra_env = dict(extra_env or {})
        self.base = base_dir
        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        self.fields = {
            "metadata.name": pod_name,
            "metadata.namespace": namespace,
            "status.podIP": "127.0.0.1",
            "spec.nodeName": socket.gethostname(),
        }
        self.volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        for name in claim_templates:  # StatefulSet volumeClaimTemplates: a claim per pod
            self.volumes.setdefault(name, {"name": name, "persistentVolumeClaim": {}})
        self.volume_dirs = {name: Path(path) for name, path in (volume_dirs or {}).items()}
        all_specs = [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
        self.containers = [
            LocalContainer(
                name=c["name"],
                spec=c,
                init=c in pod_spec.get("initContainers", []),
                root=base_dir / "containers" / c["name"] / "root",
                log_path=base_dir / "logs" / f"{c['name']}.log",
            )
            for c in all_specs
        ]
        self._prepared = False

    # -- filesystem

    def _rooted(self, value: str, root: Path) -> str:
        return str(root) + value if value.startswith("/") else value

    def _rewrite(self, value: str, root: Path) -> str:
        """A manifest string as the local process must see it: host names mapped, absolute
        paths under the container's root."""
        host, colon, port = value.rpartition(":")
        if colon and host in self.hosts and port.isdigit():
            value = f"{self.hosts[host]}:{self.port_map.get(int(port), int(port))}"
        value = self.hosts.get(value, value)
        return self._rooted(value, root)

    def _rewrite_config_text(self, text: str, root: Path) -> str:
        """A configMap file with its absolute paths under ``root`` (YAML files only)."""
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            return text

        def walk(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            if isinstance(node, str):
                return self._rewrite(node, root)
            return node

        return yaml.safe_dump(walk(doc), sort_keys=False)

    def _projected_files(self, volume: dict[str, Any]) -> dict[str, bytes] | None:
        """Files of a configMap or secret volume; None for other kinds."""
        if "configMap" in volume:
            source = volume["configMap"]
            obj = self.objects[("ConfigMap", source["name"])]
            data = {k: v.encode() for k, v in obj.get("data", {}).items()}
        elif "secret" in volume:
            source = volume["secret"]
            obj = self.objects.get(("Secret", source["secretName"]))
            if obj is None:
                raise PodError(
                    f"volume {volume['name']}: Secret {source['secretName']} is not among the "
                    "rendered objects (create it the way the docs say, then pass it in)"
                )
            data = {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
            data |= {k: v.encode() for k, v in obj.get("stringData", {}).items()}
        else:
            return None
        items = source.get("items")
        if items:
            return {item["path"]: data[item["key"]] for item in items}
        return data

    def _volume_dir(self, name: str) -> Path:
        if name in self.volume_dirs:
            return self.volume_dirs[name]
        path = self.base / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        self.volume_dirs[name] = path
        return path

    def _mount_source(self, container: LocalContainer, mount: dict[str, Any]) -> Path:
        volume = self.volumes.get(mount["name"])
        if volume is None:
            raise PodError(f"{container.name}: volumeMount {mount['name']} has no volume")
        if mount["mountPath"] == "/dev/shm":
            return Path("/dev/shm")
        files = self._projected_files(volume)
        if files is not None:  # per container: its paths are rewritten under its root
            folder = self.base / "containers" / container.name / "projected" / mount["name"]
            source = volume.get("configMap") or volume.get("secret") or {}
            if "configMap" in volume:
                files = {
                    relative: self._rewrite_config_text(content.decode(), container.root).encode()
                    for relative, content in files.items()
                }
            write_volume_files(folder, files, source.get("defaultMode", 0o644))
            return folder
        source = self._volume_dir(mount["name"])
        if mount.get("subPath"):
            source = source / mount["subPath"]
            source.mkdir(parents=True, exist_ok=True)
        return source

    def _is_read_only(self, mount: dict[str, Any]) -> bool:
        volume = self.volumes[mount["name"]]
        pvc = volume.get("persistentVolumeClaim") or {}
        return bool(
            mount.get("readOnly") or pvc.get("readOnly") or "configMap" in volume
            or "secret" in volume
        )  # fmt: skip

    def _prepare_container(self, container: LocalContainer) -> None:
        spec = container.spec
        dockerfile, build_args = image_of(spec["image"])
        image = image_config(dockerfile, build_args)
        root = container.root
        root.mkdir(parents=True)
        container.log_path.parent.mkdir(parents=True, exist_ok=True)
        workdir = spec.get("workingDir") or image.workdir
        container.cwd = container.path(workdir)
        container.cwd.mkdir(parents=True, exist_ok=True)
        for mount in spec.get("volumeMounts", []):
            link = container.path(mount["mountPath"])
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(self._mount_source(container, mount))
        make_read_only(root)

        env: dict[str, str] = {"HOME": str(root)}  # the runtime's default: "/" of the image
        env |= {k: self._rewrite(v, root) for k, v in image.env.items()}
        for var in spec.get("env", []):
            env[var["name"]] = self._rewrite(self._env_value(var, env), root)
        if spec.get("envFrom"):
            raise PodError(f"{container.name}: envFrom is not emulated")
        env |= self.extra_env
        env["PATH"] = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"
        container.env = env

        if "command" in spec:
            argv = list(spec["command"]) + list(spec.get("args", []))
        else:
            argv = image.entrypoint + list(spec.get("args", image.cmd))
        argv = [self._rewrite(_expand(arg, env), root) for arg in argv]
        executable = shutil.which(Path(argv[0]).name, path=env["PATH"])
        if executable is None:
            raise PodError(f"{container.name}: {argv[0]} is not installed in {VENV_BIN}")
        container.argv = [executable, *argv[1:]]

    def _env_value(self, var: dict[str, Any], env: Mapping[str, str]) -> str:
        if "value" in var:
            return _expand(str(var["value"]), env)
        source = var["valueFrom"]
        if "fieldRef" in source:
            return self.fields[source["fieldRef"]["fieldPath"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = self.objects[("Secret", ref["name"])]
            return base64.b64decode(secret["data"][ref["key"]]).decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.objects[("ConfigMap", ref["name"])]["data"][ref["key"]]
        raise PodError(f"env {var['name']}: {sorted(source)} is not emulated")

    def prepare(self) -> None:
        """Lay out every container's root, volumes, command line and environment."""
        self._check_mounts_are_emulable()
        for container in self.containers:
            self._prepare_container(container)
        self._prepared = True

    def _check_mounts_are_emulable(self) -> None:
        """A folder is read-only for everyone or for no one: refuse a volume that one running
        container mounts read-only and another writable (chmod cannot show two views)."""
        views: dict[str, set[bool]] = {}
        for container in self.containers:
            if container.init:
                continue
            for mount in container.spec.get("volumeMounts", []):
                if mount["name"] not in self.volumes:
                    raise PodError(f"{container.name}: volumeMount {mount['name']} has no volume")
                if mount["mountPath"] != "/dev/shm":
                    views.setdefault(mount["name"], set()).add(self._is_read_only(mount))
        mixed = sorted(name for name, modes in views.items() if modes == {True, False})
        if mixed:
            raise PodError(f"volumes {mixed} are mounted read-only and writable at once")
        self._read_only_volumes = sorted(n for n, modes in views.items() if modes == {True})

    # -- running

    def _spawn(self, container: LocalContainer) -> None:
        with open(container.log_path, "ab") as log_file:
            container.process = subprocess.Popen(
                container.argv,
                env=container.env,
                cwd=container.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_contained,
            )

    def start(self, init_timeout: float = 300) -> None:
        """Run the init containers to completion, then start the others."""
        if not self._prepared:
            self.prepare()
        for container in (c for c in self.containers if c.init):
            self._spawn(container)
            assert container.process is not None
            try:
                code = container.process.wait(timeout=init_timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise PodError(f"init container {container.name} still runs") from None
            if code != 0:
                raise PodError(
                    f"init container {container.name} exited with {code}:\n{container.log_tail()}"
                )
        for name in self._read_only_volumes:
            if name in self.volume_dirs:  # a read-only volume the init containers filled
                make_read_only(self.volume_dirs[name])
        for container in self.main_containers():
            self._spawn(container)

    def main_containers(self) -> Iterator[LocalContainer]:
        return (c for c in self.containers if not c.init)

    def container(self, name: str) -> LocalContainer:
        (found,) = [c for c in self.containers if c.name == name]
        return found

    def port(self, container: LocalContainer, port: int | str) -> int:
        """The local port of a manifest port (a number or a container port's name)."""
        if isinstance(port, str):
            named = {p["name"]: p["containerPort"] for p in container.spec.get("ports", [])}
            port = named[port]
        return self.port_map.get(port, port)

    def probe(self, container: LocalContainer, kind: str = "readinessProbe") -> str:
        """Run one probe of the container: SERVING/NOT_SERVING/... for gRPC, the HTTP code or
        error for httpGet."""
        probe = container.spec[kind]
        if "grpc" in probe:
            port = self.port(container, probe["grpc"]["port"])
            return grpc_health(f"127.0.0.1:{port}", probe["grpc"].get("service", ""))
        if "httpGet" in probe:
            port = self.port(container, probe["httpGet"]["port"])
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=2)
            except httpx.HTTPError as err:
                return type(err).__name__
            return str(reply.status_code)
        raise PodError(f"{container.name}.{kind}: only grpc and httpGet probes are emulated")

    def check_running(self) -> None:
        for container in self.main_containers():
            assert container.process is not None
            if container.process.poll() is not None:
                raise PodError(
                    f"{self.pod_name}/{container.name} exited with "
                    f"{container.process.returncode}:\n{container.log_tail()}"
                )

    def stop(self, grace: float = 30) -> None:
        """SIGTERM every container's process group, SIGKILL what is left after ``grace``."""
        started = [c for c in self.containers if c.process is not None]
        for container in started:
            assert container.process is not None
            if container.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(container.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for container in started:
            assert container.process is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                container.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # Also whatever the container's process left behind in its group (engine cores).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(container.process.pid, signal.SIGKILL)
            container.process.wait()

    def cleanup(self) -> None:
        """Make the folders writable again so tmp_path can be removed."""
        make_writable(self.base)
        for path in self.volume_dirs.values():
            make_writable(path)


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (unknown references stay as written, ``$$`` is ``$``)."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _VAR_REFERENCE.sub(replace, text)


def wait_until(
    check: Callable[[], bool], timeout: float, on_poll: Callable[[], None], what: str
) -> None:
    """Poll ``check`` every second until it is true; ``on_poll`` may raise to stop early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        on_poll()
        if check():
            return
        time.sleep(1)
    raise PodError(f"timed out after {timeout:.0f} s waiting for {what}")
