"""The controller's view of its worker pods in Kubernetes: a list-watch of the worker
StatefulSet and of its pods, through the official ``kubernetes`` client.

Membership (registration and heartbeats) says which services run; only the API server says
how many worker pods are *wanted* (the StatefulSet's ``spec.replicas``, which ``kubectl scale``
and :class:`podrl.controller.pods.scaling.KubernetesScaler` change) and which pods are going away
(a deletion timestamp is set the moment a pod is asked to stop, before its services drain or
their heartbeats stop).

:class:`KubeWatch` owns one piece of state, a :class:`ClusterView` snapshot; others only read
it (:meth:`KubeWatch.view`, :meth:`KubeWatch.wait_for`) or are told of each change
(``on_change``). One thread per resource runs the API's list-then-watch protocol:

- list: the objects and the list's resourceVersion; this replaces what was known before;
- watch from that resourceVersion; each event carries the object's new resourceVersion, which
  is kept, so a watch that ends (the server's ``timeoutSeconds``) or breaks (a dropped
  connection, a read timeout) resumes where it left off and misses nothing;
- re-list when the API answers 410 Gone: the history after that resourceVersion is gone, so
  only a fresh list is complete;
- back off exponentially (with jitter) while requests fail; the first event after a failure
  resets the delay.

The API server filters pods by ``WORKER_SELECTOR`` and the StatefulSet by name; the watch
filters again itself, so an API that ignores selectors cannot put other objects in the view.

Only :class:`KubeWatchConfig` reads the environment (what the Helm chart sets:
``WORKER_STATEFULSET``, ``WORKER_SELECTOR``, ``POD_NAMESPACE``, plus the service account that
Kubernetes mounts); :meth:`KubeWatchConfig.build` returns None outside a cluster.

The pod table reads the view: its desired count and the pods it must not admit because they are
terminating (``service/main.py``, ``build_scaling``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader

from podrl import __version__
from podrl.config.loading import ConfigError

log = logging.getLogger(__name__)

#: Sent with every request, so API server audit logs name the controller.
USER_AGENT = f"podrl-controller/{__version__}"

#: Every Kubernetes API access of the controller: (API group, resource) -> verbs. The chart's
#: Role must grant exactly these (tests/controller/test_kube_watch.py compares the two).
KUBERNETES_ACCESS: Mapping[tuple[str, str], frozenset[str]] = {
    # KubeWatch lists and watches the worker StatefulSet (by name);
    # KubernetesScaler.desired_replicas reads it.
    ("apps", "statefulsets"): frozenset({"get", "list", "watch"}),
    # KubeWatch lists and watches the StatefulSet's pods (by WORKER_SELECTOR).
    ("", "pods"): frozenset({"list", "watch"}),
    # KubernetesScaler.set_replicas, on the worker StatefulSet only.
    ("apps", "statefulsets/scale"): frozenset({"patch"}),
}

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_HTTP_GONE = 410
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def parse_selector(text: str, variable: str = "WORKER_SELECTOR") -> dict[str, str]:
    """``"k1=v1,k2=v2"`` (the chart's form) -> ``{"k1": "v1", "k2": "v2"}``.

    Only equality terms (``=`` or ``==``): they are what a StatefulSet's ``matchLabels``
    render to, and what the watch can check again on each pod's labels.
    """
    selector: dict[str, str] = {}
    for term in (t.strip() for t in text.split(",")):
        if not term:
            continue
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ConfigError(
                f"{variable}: {term!r} is not a label equality; write key=value terms "
                "separated by commas, e.g. app.kubernetes.io/component=worker"
            )
        selector[key] = value
    if not selector:
        raise ConfigError(
            f"{variable} is empty; set it to the worker StatefulSet's matchLabels as "
            "key=value,key=value (the Helm chart does)"
        )
    return selector


@dataclass(frozen=True)
class KubeWatchConfig:
    """Where the worker pods are and how to reach the API server."""

    namespace: str
    statefulset: str
    #: Label equalities every worker pod carries (the StatefulSet's ``matchLabels``).
    selector: Mapping[str, str]
    client_configuration: client.Configuration = field(repr=False, compare=False)
    #: The server ends each watch after this; the watch then resumes from its resourceVersion.
    watch_timeout_seconds: int = 300
    #: Lists and the scale call give up after this.
    request_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 10.0
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 30.0
    #: Each delay is cut by up to this fraction at random, so restarted controllers spread out.
    backoff_jitter: float = 0.2

    @property
    def label_selector(self) -> str:
        return ",".join(f"{key}={value}" for key, value in sorted(self.selector.items()))

    @property
    def watch_read_timeout_seconds(self) -> float:
        """A watch that stays silent this long is dead: longer than the server's own end."""
        return self.watch_timeout_seconds + self.request_timeout_seconds

    @classmethod
    def build(
        cls,
        env: Mapping[str, str] | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> KubeWatchConfig | None:
        """The config of the controller's pod, or None outside a cluster.

        Outside a cluster (no ``KUBERNETES_SERVICE_HOST``, which Kubernetes sets in every
        container) or without ``WORKER_STATEFULSET`` (nothing to watch), there is no
        Kubernetes path: the controller runs on membership alone. Inside, a missing or
        malformed variable, or missing service-account credentials, is a ConfigError
        naming it.
        """
        env = os.environ if env is None else env
        if not env.get("KUBERNETES_SERVICE_HOST"):
            return None
        statefulset = env.get("WORKER_STATEFULSET", "").strip()
        if not statefulset:
            log.info("WORKER_STATEFULSET is not set: not watching Kubernetes")
            return None
        selector = parse_selector(env.get("WORKER_SELECTOR", ""))
        namespace = env.get("POD_NAMESPACE", "").strip()
        namespace_file = service_account_dir / "namespace"
        if not namespace and namespace_file.is_file():
            namespace = namespace_file.read_text().strip()
        if not namespace:
            raise ConfigError(
                "POD_NAMESPACE is not set; set it from the downward API "
                "(valueFrom.fieldRef.fieldPath: metadata.namespace), as the Helm chart does"
            )
        configuration = client.Configuration()
        loader = InClusterConfigLoader(
            token_filename=str(service_account_dir / "token"),
            cert_filename=str(service_account_dir / "ca.crt"),
            environ=env,
        )
        try:
            loader.load_and_set(configuration)
        except ConfigException as exc:
            raise ConfigError(
                f"in-cluster Kubernetes credentials under {service_account_dir}: {exc}; "
                "the controller pod needs a service account token "
                "(automountServiceAccountToken: true, as the Helm chart sets)"
            ) from exc
        return cls(
            namespace=namespace,
            statefulset=statefulset,
            selector=selector,
            client_configuration=configuration,
        )

    def api_client(self) -> client.ApiClient:
        """A new client for this API server, naming the controller in its User-Agent."""
        api = client.ApiClient(self.client_configuration)
        api.user_agent = USER_AGENT
        return api


@dataclass(frozen=True)
class PodState:
    """One worker pod as the API server last described it."""

    name: str
    #: Pending, Running, Succeeded, Failed or Unknown (``status.phase``).
    phase: str
    #: The pod's Ready condition is True.
    ready: bool
    #: Set once the pod is asked to stop (scale-down, eviction, ``kubectl delete``).
    deletion_timestamp: datetime | None
    ip: str | None
    #: N of the StatefulSet pod ``<statefulset>-N``; None for a pod not named that way.
    ordinal: int | None

    @property
    def terminating(self) -> bool:
        return self.deletion_timestamp is not None


@dataclass(frozen=True)
class ClusterView:
    """What the API server says about the worker StatefulSet and its pods."""

    namespace: str
    statefulset: str
    #: Both the StatefulSet and its pods have been listed at least once.
    synced: bool = False
    #: ``spec.replicas``; None while the StatefulSet is not seen (not listed yet, or absent).
    desired_replicas: int | None = None
    #: ``status.readyReplicas``.
    ready_replicas: int = 0
    #: The worker pods, by ordinal then name.
    pods: tuple[PodState, ...] = ()

    def pod(self, name: str) -> PodState | None:
        return next((pod for pod in self.pods if pod.name == name), None)

    @property
    def terminating(self) -> frozenset[str]:
        """Names of the pods that have a deletion timestamp."""
        return frozenset(pod.name for pod in self.pods if pod.terminating)


@dataclass(frozen=True)
class WatchStatus:
    """How one resource's list-watch is doing (for logs, status pages and tests)."""

    resource: str
    #: Successful lists: the first one, plus one per re-list after 410 Gone.
    lists: int = 0
    #: Watches answered 410 Gone.
    gone: int = 0
    #: Failed requests (errors, dropped connections, timeouts), in all.
    failures: int = 0
    #: Failures since the last success; 0 while the watch is healthy.
    consecutive_failures: int = 0
    #: The delays slept after each failure of the latest run of failures.
    backoff_delays_seconds: tuple[float, ...] = ()
    last_error: str | None = None
    #: Where a resumed watch starts; None until listed and after 410 Gone.
    resource_version: str | None = None


class Backoff:
    """Exponential delays for consecutive failures: initial, times ``factor``, up to ``maximum``.

    ``jitter`` cuts each delay by a random fraction of up to that much.
    """

    def __init__(
        self, initial: float, maximum: float, factor: float = 2.0, jitter: float = 0.0
    ) -> None:
        if initial <= 0 or maximum < initial or factor < 1 or not 0 <= jitter < 1:
            raise ValueError(
                "backoff: need 0 < initial <= maximum, factor >= 1 and 0 <= jitter < 1; got "
                f"initial={initial}, maximum={maximum}, factor={factor}, jitter={jitter}"
            )
        self.initial, self.maximum, self.factor, self.jitter = initial, maximum, factor, jitter
        self.failures = 0

    def next_delay(self) -> float:
        """Count one more failure; the delay to wait before the next attempt."""
        delay = min(self.maximum, self.initial * self.factor**self.failures)
        self.failures += 1
        return delay * (1 - self.jitter * random.random())

    def reset(self) -> None:
        self.failures = 0


def _pod_state(obj: Mapping[str, Any], statefulset: str) -> PodState:
    metadata = obj.get("metadata") or {}
    status = obj.get("status") or {}
    name = str(metadata.get("name", ""))
    conditions = status.get("conditions") or []
    suffix = name[len(statefulset) + 1 :] if name.startswith(f"{statefulset}-") else ""
    return PodState(
        name=name,
        phase=str(status.get("phase") or "Pending"),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        deletion_timestamp=_timestamp(metadata.get("deletionTimestamp")),
        ip=status.get("podIP") or None,
        ordinal=int(suffix) if suffix.isdigit() else None,
    )


def _timestamp(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:  # an unreadable timestamp still means "being deleted"
        return datetime.min


def _labels_match(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


# Why the list functions are wrapped: kubernetes.watch.Watch deserializes each event's object
# into the model type named by the function's return annotation. A plain function without one
# makes it pass the objects through as dicts (and it still turns ERROR events into
# ApiException), so a watch never fails on a model's validation of an odd object.
def _raw_lister(method: Callable[..., Any], namespace: str) -> Callable[..., Any]:
    def list_objects(**kwargs: Any):  # no return annotation: see above
        return method(namespace, **kwargs)

    return list_objects


class _ResourceWatch:
    """The list-then-watch loop of one resource, run by its own thread."""

    def __init__(
        self,
        resource: str,
        lister: Callable[..., Any],
        selectors: Mapping[str, str],
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        config: KubeWatchConfig,
        stop: threading.Event,
    ) -> None:
        self.resource = resource
        self._lister = lister
        self._selectors = dict(selectors)
        self._on_list = on_list
        self._on_event = on_event
        self._config = config
        self._stop = stop
        self._backoff = Backoff(
            config.backoff_initial_seconds,
            config.backoff_max_seconds,
            jitter=config.backoff_jitter,
        )
        self._watch = watch.Watch()
        self._lock = threading.Lock()
        self._status = WatchStatus(resource)
        self._gone_in_a_row = 0

    def status(self) -> WatchStatus:
        with self._lock:
            return self._status

    def _update_status(self, change: Callable[[WatchStatus], dict[str, Any]]) -> None:
        """Replace the status with ``change(status)``'s fields changed."""
        with self._lock:
            self._status = dataclasses.replace(self._status, **change(self._status))

    def interrupt(self) -> None:
        """Break an open watch connection (for stop)."""
        self._watch.stop()

    def run(self) -> None:
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                resource_version = self._watch_from(resource_version)
            except ApiException as exc:
                if self._stop.is_set():
                    break
                if exc.status == _HTTP_GONE:
                    self._gone_in_a_row += 1
                    self._update_status(lambda s: {"gone": s.gone + 1, "resource_version": None})
                    log.info(
                        "watch %s: resourceVersion %s gone (410); re-listing",
                        self.resource,
                        resource_version,
                    )
                    resource_version = None
                    if self._gone_in_a_row == 1:
                        continue  # re-list at once; a second 410 in a row backs off
                self._failed(exc)
            except Exception as exc:  # refused or dropped connection, timeout, bad response
                if self._stop.is_set():
                    break
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        delay = self._backoff.next_delay()
        # A new run of failures starts a new list of delays.
        self._update_status(
            lambda s: {
                "failures": s.failures + 1,
                "consecutive_failures": s.consecutive_failures + 1,
                "backoff_delays_seconds": (
                    *(s.backoff_delays_seconds if s.consecutive_failures else ()),
                    delay,
                ),
                "last_error": f"{type(exc).__name__}: {exc}"[:500],
            }
        )
        log.warning(
            "watch %s: %s: %s; retrying in %.2f s",
            self.resource,
            type(exc).__name__,
            str(exc)[:300],
            delay,
        )
        self._stop.wait(delay)

    def _succeeded(self, resource_version: str | None, watched: bool = True) -> None:
        self._backoff.reset()
        if watched:  # a list alone does not end a run of 410s: its watch may be gone again
            self._gone_in_a_row = 0
        self._update_status(
            lambda s: {"consecutive_failures": 0, "resource_version": resource_version}
        )

    def _list(self) -> str:
        config = self._config
        response = self._lister(
            _preload_content=False,
            _request_timeout=(config.connect_timeout_seconds, config.request_timeout_seconds),
            **self._selectors,
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        items = [item for item in body.get("items") or [] if isinstance(item, dict)]
        resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._on_list(items)
        self._update_status(lambda s: {"lists": s.lists + 1})
        self._succeeded(resource_version, watched=False)
        return resource_version

    def _events(self, resource_version: str) -> Iterator[dict[str, Any]]:
        config = self._config
        yield from self._watch.stream(
            self._lister,
            resource_version=resource_version,
            timeout_seconds=config.watch_timeout_seconds,
            allow_watch_bookmarks=True,
            _request_timeout=(config.connect_timeout_seconds, config.watch_read_timeout_seconds),
            **self._selectors,
        )

    def _watch_from(self, resource_version: str) -> str:
        """Follow events from ``resource_version``; the last resourceVersion seen when the
        server ends the watch. Raises when the connection breaks or the API answers an error."""
        for event in self._events(resource_version):
            if self._stop.is_set():
                break
            obj = event.get("object")
            if not isinstance(obj, dict):
                continue
            resource_version = str(
                (obj.get("metadata") or {}).get("resourceVersion") or resource_version
            )
            kind = str(event.get("type", ""))
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._on_event(kind, obj)
            self._succeeded(resource_version)  # BOOKMARKs too: the connection works
        if not self._stop.is_set():
            self._succeeded(resource_version)  # the server ended the watch: resume from here
        return resource_version


class KubeWatch:
    """List-watch of the worker StatefulSet and its pods; owns the :class:`ClusterView`.

    ``on_change(view)`` runs in a watch thread after each change of the view, one call at a
    time and in order; keep it short (it delays the next event), and what it raises is logged
    and ignored.
    """

    def __init__(
        self,
        config: KubeWatchConfig,
        on_change: Callable[[ClusterView], None] | None = None,
    ) -> None:
        self.config = config
        self._on_change = on_change
        self._state = threading.Condition()
        self._deliver = threading.Lock()  # orders "change the view" + "tell on_change"
        self._view = ClusterView(config.namespace, config.statefulset)
        self._pods: dict[str, PodState] = {}
        self._statefulset: tuple[int, int] | None = None  # (desired, ready)
        self._listed: set[str] = set()
        self._stop = threading.Event()
        self._clients: list[client.ApiClient] = []
        self._watches: list[_ResourceWatch] = []
        self._threads: list[threading.Thread] = []

    # --- reading -----------------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The latest snapshot (immutable)."""
        with self._state:
            return self._view

    def wait_for(self, predicate: Callable[[ClusterView], bool], timeout: float) -> ClusterView:
        """Block until ``predicate(view)`` holds; the view. TimeoutError names the last view."""
        with self._state:
            if not self._state.wait_for(lambda: predicate(self._view), timeout):
                raise TimeoutError(f"no matching cluster view within {timeout} s: {self._view}")
            return self._view

    @property
    def running(self) -> bool:
        """A watch thread is still alive (after stop: one that did not end in time)."""
        return any(thread.is_alive() for thread in self._threads)

    def status(self) -> dict[str, WatchStatus]:
        """Per resource ("statefulsets", "pods"): how its list-watch is doing."""
        return {w.resource: w.status() for w in self._watches}

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the two watch threads (once)."""
        if self._threads:
            raise RuntimeError("KubeWatch.start: already started")
        config = self.config
        apps = client.AppsV1Api(self._new_client())
        core = client.CoreV1Api(self._new_client())
        self._watches = [
            _ResourceWatch(
                "statefulsets",
                _raw_lister(apps.list_namespaced_stateful_set, config.namespace),
                {"field_selector": f"metadata.name={config.statefulset}"},
                self._on_statefulset_list,
                self._on_statefulset_event,
                config,
                self._stop,
            ),
            _ResourceWatch(
                "pods",
                _raw_lister(core.list_namespaced_pod, config.namespace),
                {"label_selector": config.label_selector},
                self._on_pod_list,
                self._on_pod_event,
                config,
                self._stop,
            ),
        ]
        for resource_watch in self._watches:
            thread = threading.Thread(
                target=resource_watch.run, name=f"kube-watch-{resource_watch.resource}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads: open watches are broken off; waits up to ``timeout`` seconds."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for resource_watch, thread in zip(self._watches, self._threads, strict=True):
            # Repeated: a watch request still being sent cannot be broken until it is open.
            while thread.is_alive() and time.monotonic() < deadline:
                resource_watch.interrupt()
                thread.join(0.05)
            if thread.is_alive():
                log.warning("watch %s did not stop within %s s", resource_watch.resource, timeout)
        for api in self._clients:
            api.close()

    def __enter__(self) -> KubeWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _new_client(self) -> client.ApiClient:
        api = self.config.api_client()  # one per thread: urllib3 pools are, ApiClient is not
        self._clients.append(api)
        return api

    # --- applying what the API says ----------------------------------------------------------

    def _change(self, mutate: Callable[[], None]) -> None:
        with self._deliver:
            with self._state:
                mutate()
                view = ClusterView(
                    namespace=self.config.namespace,
                    statefulset=self.config.statefulset,
                    synced=self._listed >= {"statefulsets", "pods"},
                    desired_replicas=None if self._statefulset is None else self._statefulset[0],
                    ready_replicas=0 if self._statefulset is None else self._statefulset[1],
                    pods=tuple(
                        sorted(
                            self._pods.values(),
                            key=lambda p: (p.ordinal is None, p.ordinal or 0, p.name),
                        )
                    ),
                )
                if view == self._view:
                    return
                self._view = view
                self._state.notify_all()
            if self._on_change is not None:
                try:
                    self._on_change(view)
                except Exception:
                    log.exception("KubeWatch on_change failed; the watch goes on")

    def _is_worker_statefulset(self, obj: Mapping[str, Any]) -> bool:
        return (obj.get("metadata") or {}).get("name") == self.config.statefulset

    @staticmethod
    def _replicas(obj: Mapping[str, Any]) -> tuple[int, int]:
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        desired = spec.get("replicas")
        # The API server defaults an omitted spec.replicas to 1.
        return (1 if desired is None else int(desired)), int(status.get("readyReplicas") or 0)

    def _on_statefulset_list(self, items: list[dict[str, Any]]) -> None:
        mine = [item for item in items if self._is_worker_statefulset(item)]

        def mutate() -> None:
            self._statefulset = self._replicas(mine[0]) if mine else None
            self._listed.add("statefulsets")

        self._change(mutate)

    def _on_statefulset_event(self, kind: str, obj: dict[str, Any]) -> None:
        if not self._is_worker_statefulset(obj):
            return

        def mutate() -> None:
            self._statefulset = None if kind == "DELETED" else self._replicas(obj)

        self._change(mutate)

    def _on_pod_list(self, items: list[dict[str, Any]]) -> None:
        pods = [
            _pod_state(item, self.config.statefulset)
            for item in items
            if _labels_match(item, self.config.selector)
        ]

        def mutate() -> None:
            self._pods = {pod.name: pod for pod in pods if pod.name}
            self._listed.add("pods")

        self._change(mutate)

    def _on_pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        pod = _pod_state(obj, self.config.statefulset)
        if not pod.name:
            return
        # A pod whose labels stop matching has left the StatefulSet: gone from the view too.
        keep = kind != "DELETED" and _labels_match(obj, self.config.selector)

        def mutate() -> None:
            if keep:
                self._pods[pod.name] = pod
            else:
                self._pods.pop(pod.name, None)

        self._change(mutate)
