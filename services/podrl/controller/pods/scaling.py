"""Setting the number of worker pods: one interface, in a cluster and locally.

Whoever asks for N pods (the REST call ``PUT /v1/workers/replicas``, ``podrl scale``) goes
through a :class:`ReplicaScaler`:

- :class:`KubernetesScaler` (in a cluster): patches ``statefulsets/scale`` of the worker
  StatefulSet, exactly what ``kubectl scale`` does; the StatefulSet controller then starts
  or stops pods, and :class:`podrl.controller.pods.kube_watch.KubeWatch` sees them.
- :class:`LocalScaler` (``podrl up`` / ``podrl run``): the controller's desired count; the
  local launcher reads it from the controller's status (``desired_replicas``) and reconciles
  its pod process groups to it (``podrl.cli.local_cluster``).

:func:`build_scaler` picks one from the environment.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    # The kubernetes client is imported only where a KubernetesScaler is made, so the local
    # launcher (LocalScaler, podrl up) runs in images without it (the trainer's, say).
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from podrl.controller.pods.kube_watch import KubeWatchConfig

log = logging.getLogger(__name__)


@runtime_checkable
class ReplicaScaler(Protocol):
    """Sets and reports the desired number of worker pods."""

    def set_replicas(self, replicas: int) -> None:
        """Ask for ``replicas`` worker pods (returns once the request is recorded)."""
        ...

    def desired_replicas(self) -> int:
        """The number of worker pods asked for."""
        ...


class ScaleError(RuntimeError):
    """The desired pod count could not be set or read; the message says why and the fix.

    ``http_status`` is the API server's answer (403, 404, ...) or None when there was none.
    """

    def __init__(self, message: str, http_status: int | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status


def check_replicas(replicas: object) -> int:
    """``replicas`` as a pod count; ValueError naming the field unless an integer >= 0."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be an integer >= 0, got {replicas!r}")
    return replicas


class KubernetesScaler:
    """Scales the worker StatefulSet through its ``scale`` subresource."""

    def __init__(self, config: KubeWatchConfig) -> None:
        from kubernetes import client

        self.config = config
        self._api = client.AppsV1Api(config.api_client())

    @property
    def _target(self) -> str:
        return f"StatefulSet {self.config.namespace}/{self.config.statefulset}"

    def set_replicas(self, replicas: int) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        replicas = check_replicas(replicas)
        config = self.config
        try:
            # A merge patch of spec.replicas, as `kubectl scale` sends: no read-modify-write,
            # so it cannot conflict with the StatefulSet controller's status updates.
            self._api.patch_namespaced_stateful_set_scale(
                config.statefulset,
                config.namespace,
                {"spec": {"replicas": replicas}},
                _content_type="application/merge-patch+json",
                _request_timeout=(config.connect_timeout_seconds, config.request_timeout_seconds),
            )
        except ApiException as exc:
            raise self._error(exc, f"patch statefulsets/scale to {replicas}") from exc
        except HTTPError as exc:
            raise self._unreachable(exc) from exc
        log.info("%s: asked for %d replicas", self._target, replicas)

    def desired_replicas(self) -> int:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        config = self.config
        try:
            response = self._api.read_namespaced_stateful_set(
                config.statefulset,
                config.namespace,
                _preload_content=False,
                _request_timeout=(config.connect_timeout_seconds, config.request_timeout_seconds),
            )
        except ApiException as exc:
            raise self._error(exc, "get statefulsets") from exc
        except HTTPError as exc:
            raise self._unreachable(exc) from exc
        try:
            statefulset = json.loads(response.data)
        finally:
            response.release_conn()
        replicas = (statefulset.get("spec") or {}).get("replicas")
        return 1 if replicas is None else int(replicas)  # the API's default for an omitted one

    def close(self) -> None:
        self._api.api_client.close()

    def _error(self, exc: ApiException, action: str) -> ScaleError:
        status = exc.status
        if status in (401, 403):
            fix = (
                f"the controller's service account may not {action} on {self._target}; "
                "its Role must grant it (Helm: controller.rbac.create=true)"
            )
        elif status == 404:
            fix = (
                f"{self._target} does not exist; WORKER_STATEFULSET must name this release's "
                "worker StatefulSet (the Helm chart sets it)"
            )
        else:
            fix = f"{action} on {self._target} failed: {exc.reason}"
        return ScaleError(f"{fix} (HTTP {status})", http_status=status)

    def _unreachable(self, exc: HTTPError) -> ScaleError:
        host = self.config.client_configuration.host
        return ScaleError(f"cannot reach the Kubernetes API server at {host}: {exc}")


class LocalScaler:
    """The desired pod count of a local run; ``on_change(n)`` tells the launcher.

    ``on_change`` runs in the caller's thread, only when the count changes, and one call at a
    time, in order.
    """

    def __init__(self, replicas: int = 1, on_change: Callable[[int], None] | None = None) -> None:
        self._replicas = check_replicas(replicas)
        self._on_change = on_change
        self._lock = threading.Lock()

    def set_replicas(self, replicas: int) -> None:
        replicas = check_replicas(replicas)
        with self._lock:
            if replicas == self._replicas:
                return
            self._replicas = replicas
            if self._on_change is not None:
                self._on_change(replicas)

    def desired_replicas(self) -> int:
        with self._lock:
            return self._replicas


def build_scaler(kube: KubeWatchConfig | None, local_replicas: int = 1) -> ReplicaScaler:
    """In a cluster (``kube`` from :meth:`KubeWatchConfig.build`) the StatefulSet's scale;
    otherwise a :class:`LocalScaler` starting at ``local_replicas``."""
    if kube is not None:
        return KubernetesScaler(kube)
    return LocalScaler(local_replicas)
