"""The Kubernetes path of the controller: KubeWatch (list-watch of the worker StatefulSet and
its pods), KubernetesScaler (``statefulsets/scale``) and the verbs both use.

No API server installs here, so the watch runs against ``tests/controller/kube_api.py``:
kmock's Kubernetes emulation over real HTTP on loopback, plus resourceVersions, 410 Gone,
injected connection faults and a minimal ``statefulsets/{name}/scale`` handler (kmock has
none) that stores ``spec.replicas`` into the emulated StatefulSet behind the same HTTP API
the real client and ``kubectl`` use. Scaling is driven both by the real ``kubectl`` binary
(``kubectl scale --server http://127.0.0.1:PORT``) and by KubernetesScaler. Every request of
the code under test goes through the official ``kubernetes`` client.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from podrl.config.loading import ConfigError
from podrl.controller.pods.kube_watch import (
    KUBERNETES_ACCESS,
    USER_AGENT,
    Backoff,
    ClusterView,
    KubeWatch,
    KubeWatchConfig,
    _pod_state,
    parse_selector,
)
from podrl.controller.pods.scaling import (
    KubernetesScaler,
    LocalScaler,
    ReplicaScaler,
    ScaleError,
    build_scaler,
    check_replicas,
)
from podrl.tools.helm_binary import kubectl_path
from podrl.tools.render_k8s import helm_template, parse_objects
from tests.controller.kube_api import ApiServer
from tests.controller.kube_objects import (
    BACKOFF_INITIAL,
    NAMESPACE,
    SELECTOR,
    STATEFULSET,
    WAIT_SECONDS,
    create_pod,
    create_statefulset,
    watch_config,
)

# --- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as api_server:
        yield api_server


@pytest.fixture
def kube(server: ApiServer) -> Iterator[client.ApiClient]:
    """The test's own client (its default User-Agent tells its requests from the code's)."""
    api = client.ApiClient(server.configuration())
    yield api
    api.close()


@pytest.fixture
def started() -> Iterator[Callable[..., KubeWatch]]:
    """Start a KubeWatch; stopped (and checked stopped) at teardown."""
    watches: list[KubeWatch] = []

    def start(config: KubeWatchConfig, **kwargs: Any) -> KubeWatch:
        kube_watch = KubeWatch(config, **kwargs)
        kube_watch.start()
        watches.append(kube_watch)
        return kube_watch

    yield start
    for kube_watch in watches:
        kube_watch.stop()
        assert not kube_watch.running


def merge_patch(method: Callable[..., Any], *args: Any) -> None:
    method(*args, _content_type="application/merge-patch+json")


def kubectl(server: ApiServer, tmp_path: Path, *args: str) -> str:
    """The real kubectl against the emulated API server (no kubeconfig, no cache outside)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.touch()
    command = [str(kubectl_path()), "--server", server.url, "-n", NAMESPACE]
    command += ["--cache-dir", str(tmp_path / "kube-cache"), *args]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def names(view: ClusterView) -> list[str]:
    return [pod.name for pod in view.pods]


def code_calls(server: ApiServer) -> list[Any]:
    assert server.api is not None
    return [call for call in server.api.calls if call.user_agent == USER_AGENT]


def disconnect_and_hold(server: ApiServer, kube_watch: KubeWatch) -> None:
    """Break both open watches; their reconnects wait in the server until released."""
    assert server.api is not None
    following, held = server.api.following, server.api.held
    wait_until(lambda: following["pods"] == following["statefulsets"] == 1, "both watches open")
    server.call(lambda api: api.hold_watches())
    assert server.call(lambda api: api.drop_watches()) == 2
    wait_until(lambda: held["pods"] == 1 and held["statefulsets"] == 1, "both watches held")


# --- the watch against the emulated API server ----------------------------------------------


def test_view_follows_replicas_set_by_kubectl_and_by_the_scaler(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch], tmp_path: Path
) -> None:
    create_statefulset(kube, replicas=1, ready=1)
    create_pod(kube, "podrl-worker-0")
    # Not a worker: another component's pod in the same namespace. The emulated API ignores
    # labelSelector, so only the watch's own filter keeps it out.
    create_pod(
        kube, "podrl-controller-abc", labels={**SELECTOR, "app.kubernetes.io/component": "x"}
    )
    kube_watch = started(watch_config(server))

    view = kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)
    assert (view.desired_replicas, view.ready_replicas) == (1, 1)
    assert names(view) == ["podrl-worker-0"]
    pod = view.pod("podrl-worker-0")
    assert pod is not None
    assert (pod.phase, pod.ready, pod.ip, pod.ordinal, pod.terminating) == (
        "Running",
        True,
        "10.1.0.1",
        0,
        False,
    )

    assert "scaled" in kubectl(
        server, tmp_path, "scale", f"statefulset/{STATEFULSET}", "--replicas", "3"
    )
    kube_watch.wait_for(lambda v: v.desired_replicas == 3, WAIT_SECONDS)

    # The pods the StatefulSet controller would start; ordinal order, not name order.
    create_pod(kube, "podrl-worker-10", ready=False, ip="10.1.0.10")
    create_pod(kube, "podrl-worker-2", ready=False, ip="10.1.0.2")
    view = kube_watch.wait_for(lambda v: len(v.pods) == 3, WAIT_SECONDS)
    assert names(view) == ["podrl-worker-0", "podrl-worker-2", "podrl-worker-10"]
    merge_patch(
        client.CoreV1Api(kube).patch_namespaced_pod_status,
        "podrl-worker-2",
        NAMESPACE,
        {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
    )
    merge_patch(
        client.AppsV1Api(kube).patch_namespaced_stateful_set_status,
        STATEFULSET,
        NAMESPACE,
        {"status": {"readyReplicas": 2}},
    )
    kube_watch.wait_for(lambda v: v.ready_replicas == 2, WAIT_SECONDS)
    kube_watch.wait_for(lambda v: v.pod("podrl-worker-2").ready, WAIT_SECONDS)

    scaler = KubernetesScaler(watch_config(server))
    try:
        scaler.set_replicas(2)
        kube_watch.wait_for(lambda v: v.desired_replicas == 2, WAIT_SECONDS)
        assert scaler.desired_replicas() == 2
        # The scaler sends what kubectl sends: a merge patch of the scale subresource.
        assert server.api is not None
        scale_calls = [c for c in server.api.calls if c.resource == "statefulsets/scale"]
        assert [(c.user_agent.split("/")[0], c.verb, c.content_type) for c in scale_calls] == [
            ("kubectl", "patch", "application/merge-patch+json"),
            ("podrl-controller", "patch", "application/merge-patch+json"),
        ]
        # kubectl reads back what the scaler stored.
        assert (
            kubectl(
                server,
                tmp_path,
                "get",
                f"statefulset/{STATEFULSET}",
                "-o",
                "jsonpath={.spec.replicas}",
            )
            == "2"
        )
    finally:
        scaler.close()


def test_pod_with_a_deletion_timestamp_is_terminating_until_it_is_gone(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    create_statefulset(kube, replicas=2)
    create_pod(kube, "podrl-worker-0")
    # A finalizer keeps the deleted pod around with its deletion timestamp, as a pod is while
    # its containers get SIGTERM and drain.
    create_pod(kube, "podrl-worker-1", finalizers=["podrl.test/hold"])
    views: list[ClusterView] = []

    def on_change(view: ClusterView) -> None:
        assert threading.current_thread().name.startswith("kube-watch-")
        views.append(view)
        if len(views) == 1:
            raise RuntimeError("a failing callback must not stop the watch")

    kube_watch = started(watch_config(server), on_change=on_change)
    kube_watch.wait_for(lambda v: v.synced and len(v.pods) == 2, WAIT_SECONDS)
    assert kube_watch.view().terminating == frozenset()

    core = client.CoreV1Api(kube)
    core.delete_namespaced_pod("podrl-worker-1", NAMESPACE)
    view = kube_watch.wait_for(lambda v: bool(v.terminating), WAIT_SECONDS)
    assert view.terminating == {"podrl-worker-1"}
    pod = view.pod("podrl-worker-1")
    assert pod is not None and isinstance(pod.deletion_timestamp, datetime)

    merge_patch(
        core.patch_namespaced_pod, "podrl-worker-1", NAMESPACE, {"metadata": {"finalizers": None}}
    )
    view = kube_watch.wait_for(lambda v: v.pod("podrl-worker-1") is None, WAIT_SECONDS)
    assert names(view) == ["podrl-worker-0"]

    # on_change saw every state in order, after its own first failure.
    terminating_at = next(i for i, v in enumerate(views) if v.terminating)
    gone_at = next(i for i, v in enumerate(views) if v.synced and v.pod("podrl-worker-1") is None)
    assert 0 < terminating_at < gone_at == len(views) - 1
    assert views[-1] == kube_watch.view()


def test_410_gone_relists_and_no_change_is_lost(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    create_statefulset(kube, replicas=2)
    create_pod(kube, "podrl-worker-0")
    create_pod(kube, "podrl-worker-1")
    kube_watch = started(watch_config(server))
    kube_watch.wait_for(lambda v: v.synced and len(v.pods) == 2, WAIT_SECONDS)

    # While the watcher is disconnected: a pod is deleted, one is added, the StatefulSet is
    # scaled; then the history is compacted, so the watcher's resourceVersion is too old.
    disconnect_and_hold(server, kube_watch)
    core = client.CoreV1Api(kube)
    core.delete_namespaced_pod("podrl-worker-1", NAMESPACE)
    create_pod(kube, "podrl-worker-2")
    scaler = KubernetesScaler(watch_config(server))
    scaler.set_replicas(3)
    scaler.close()
    server.call(lambda api: api.compact())
    server.call(lambda api: api.release_watches())

    view = kube_watch.wait_for(
        lambda v: v.desired_replicas == 3 and names(v) == ["podrl-worker-0", "podrl-worker-2"],
        WAIT_SECONDS,
    )
    assert view.synced
    assert server.api is not None
    assert server.api.gone_answers == {"pods": 1, "statefulsets": 1}
    for resource, status in kube_watch.status().items():
        assert (status.lists, status.gone) == (2, 1), resource

    # The re-listed watch follows new changes again.
    create_pod(kube, "podrl-worker-1")
    kube_watch.wait_for(lambda v: len(v.pods) == 3, WAIT_SECONDS)


def test_410_again_right_after_a_relist_backs_off(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    create_statefulset(kube)
    assert server.api is not None
    server.api.expire_watches = True  # an API server whose watches are always gone
    kube_watch = started(watch_config(server))
    wait_until(lambda: kube_watch.status()["pods"].gone >= 4, "four 410s")
    pods = kube_watch.status()["pods"]
    # list, 410, re-list at once, 410 again: that one waits its backoff delay first.
    assert pods.failures >= pods.gone // 2 - 1 >= 1
    server.api.expire_watches = False
    create_pod(kube, "podrl-worker-0")
    kube_watch.wait_for(lambda v: len(v.pods) == 1, WAIT_SECONDS)


def test_dropped_watch_backs_off_and_resumes_from_its_resource_version(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch], tmp_path: Path
) -> None:
    create_statefulset(kube, replicas=1)
    create_pod(kube, "podrl-worker-0")
    kube_watch = started(watch_config(server))
    kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)
    last_seen = kube_watch.status()["pods"].resource_version
    assert last_seen

    # The pods watch: dropped, then two reconnects answered 503, then one that works.
    server.call(lambda api: api.fail_watches("pods", 2))
    disconnect_and_hold(server, kube_watch)
    create_pod(kube, "podrl-worker-1")
    kubectl(server, tmp_path, "scale", f"statefulset/{STATEFULSET}", "--replicas", "2")
    server.call(lambda api: api.release_watches())
    view = kube_watch.wait_for(lambda v: v.desired_replicas == 2 and len(v.pods) == 2, WAIT_SECONDS)
    assert names(view) == ["podrl-worker-0", "podrl-worker-1"]

    pods, statefulsets = kube_watch.status()["pods"], kube_watch.status()["statefulsets"]
    assert pods.backoff_delays_seconds == (
        BACKOFF_INITIAL,
        2 * BACKOFF_INITIAL,
        4 * BACKOFF_INITIAL,
    )
    assert statefulsets.backoff_delays_seconds == (BACKOFF_INITIAL,)
    assert (pods.failures, pods.consecutive_failures, pods.lists) == (3, 0, 1)
    assert (statefulsets.failures, statefulsets.consecutive_failures, statefulsets.lists) == (
        1,
        0,
        1,
    )
    # Every reconnect resumed where the watch had been (no re-list, nothing replayed twice).
    pod_watches = [c for c in code_calls(server) if c.resource == "pods" and c.verb == "watch"]
    assert [c.params.get("resourceVersion") for c in pod_watches] == [last_seen] * 4

    # The next failure starts again from the initial delay.
    disconnect_and_hold(server, kube_watch)
    create_pod(kube, "podrl-worker-2")
    server.call(lambda api: api.release_watches())
    kube_watch.wait_for(lambda v: len(v.pods) == 3, WAIT_SECONDS)
    pods = kube_watch.status()["pods"]
    assert (pods.backoff_delays_seconds, pods.failures, pods.lists) == ((BACKOFF_INITIAL,), 4, 1)


def test_stop_breaks_off_an_open_watch(server: ApiServer, kube: client.ApiClient) -> None:
    create_statefulset(kube)
    # The server would end this watch only after 10 minutes.
    kube_watch = KubeWatch(watch_config(server, watch_timeout_seconds=600))
    kube_watch.start()
    kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)
    assert server.api is not None
    wait_until(lambda: len([c for c in code_calls(server) if c.verb == "watch"]) == 2, "watches")
    kube_watch.stop(timeout=20)
    assert not kube_watch.running


def test_watch_ended_by_the_server_resumes_and_a_silent_one_times_out(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    create_statefulset(kube)
    # The server ends each watch after 1 s; a watch silent for 1 + 1 s is dead.
    config = watch_config(server, watch_timeout_seconds=1, request_timeout_seconds=1.0)
    kube_watch = started(config)
    kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)

    def pod_watches() -> list[Any]:
        return [c for c in code_calls(server) if c.resource == "pods" and c.verb == "watch"]

    wait_until(lambda: len(pod_watches()) >= 3, "the watch resumed after the server ended it")
    pods = kube_watch.status()["pods"]
    assert (pods.failures, pods.lists) == (0, 1)
    assert len({c.params["resourceVersion"] for c in pod_watches()}) == 1

    assert server.api is not None
    server.api.stall_watches = True
    wait_until(lambda: kube_watch.status()["pods"].failures >= 1, "a read timeout")
    assert "timed out" in (kube_watch.status()["pods"].last_error or "").lower()
    server.api.stall_watches = False
    create_pod(kube, "podrl-worker-0")
    kube_watch.wait_for(lambda v: len(v.pods) == 1, WAIT_SECONDS)
    assert kube_watch.status()["pods"].lists == 1


def test_without_the_statefulset_nothing_is_desired(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    # Another StatefulSet in the namespace; the emulated API ignores the fieldSelector by name.
    create_statefulset(kube, replicas=7, name="podrl-other")
    kube_watch = started(watch_config(server))
    view = kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)
    assert (view.desired_replicas, view.pods) == (None, ())
    create_statefulset(kube, replicas=4)
    kube_watch.wait_for(lambda v: v.desired_replicas == 4, WAIT_SECONDS)
    client.AppsV1Api(kube).delete_namespaced_stateful_set(STATEFULSET, NAMESPACE)
    kube_watch.wait_for(lambda v: v.desired_replicas is None, WAIT_SECONDS)


# --- the verbs: what the code calls == the table == the chart's Role --------------------------


def _flat(access: Mapping[tuple[str, str], Iterable[str]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb) for (group, resource), verbs in access.items() for verb in verbs
    }


def test_the_watch_and_the_scaler_call_exactly_the_access_table(
    server: ApiServer, kube: client.ApiClient, started: Callable[..., KubeWatch]
) -> None:
    create_statefulset(kube)
    create_pod(kube, "podrl-worker-0")
    kube_watch = started(watch_config(server))
    kube_watch.wait_for(lambda v: v.synced, WAIT_SECONDS)
    scaler = KubernetesScaler(watch_config(server))
    scaler.set_replicas(2)
    assert scaler.desired_replicas() == 2
    scaler.close()
    kube_watch.wait_for(lambda v: v.desired_replicas == 2, WAIT_SECONDS)
    used = {(c.group, c.resource, c.verb) for c in code_calls(server)}
    assert used == _flat(KUBERNETES_ACCESS)
    # The server is asked to filter too: pods by the selector, the StatefulSet by name.
    config = watch_config(server)
    for call in code_calls(server):
        if call.resource == "pods":
            assert call.params["labelSelector"] == config.label_selector
        elif call.verb in ("list", "watch"):
            assert call.params["fieldSelector"] == f"metadata.name={STATEFULSET}"


# The chart grants these, but no code calls them; the chart's owner removes them (then this set
# empties, and the test below fails until it is emptied here too).
def test_chart_role_grants_exactly_the_access_table() -> None:
    objects = parse_objects(helm_template({}))
    role = next(o for o in objects if o["kind"] == "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # No more and no less than the code calls.
    assert granted == _flat(KUBERNETES_ACCESS)

    # The one write is limited to the StatefulSet the controller is told to watch, and the
    # selector it is told matches that StatefulSet's pods.
    controller = next(
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-controller")
    )
    env = {
        e["name"]: e.get("value")
        for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    scale_rules = [r for r in role["rules"] if "statefulsets/scale" in r["resources"]]
    assert [r.get("resourceNames") for r in scale_rules] == [[env["WORKER_STATEFULSET"]]]
    workers = next(o for o in objects if o["kind"] == "StatefulSet")
    assert workers["metadata"]["name"] == env["WORKER_STATEFULSET"]
    assert parse_selector(env["WORKER_SELECTOR"]) == workers["spec"]["selector"]["matchLabels"]
    assert "POD_NAMESPACE" in env


# --- config from the environment -------------------------------------------------------------


CHART_ENV = {
    "KUBERNETES_SERVICE_HOST": "127.0.0.1",
    "KUBERNETES_SERVICE_PORT": "6443",
    "WORKER_STATEFULSET": STATEFULSET,
    "WORKER_SELECTOR": ",".join(f"{k}={v}" for k, v in SELECTOR.items()),
    "POD_NAMESPACE": NAMESPACE,
}


@pytest.fixture
def service_account(tmp_path: Path) -> Path:
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    (folder / "token").write_text("token-of-the-test")
    (folder / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return folder


def test_config_in_a_cluster(service_account: Path) -> None:
    config = KubeWatchConfig.build(CHART_ENV, service_account_dir=service_account)
    assert config is not None
    assert (config.namespace, config.statefulset, dict(config.selector)) == (
        NAMESPACE,
        STATEFULSET,
        SELECTOR,
    )
    assert config.client_configuration.host == "https://127.0.0.1:6443"
    assert config.client_configuration.api_key["BearerToken"] == "bearer token-of-the-test"
    assert config.client_configuration.ssl_ca_cert == str(service_account / "ca.crt")
    assert config.label_selector == ",".join(f"{k}={v}" for k, v in sorted(SELECTOR.items()))
    # The defaults docs/scaling.md states.
    assert config.watch_timeout_seconds == 300
    assert (
        config.backoff_initial_seconds,
        config.backoff_max_seconds,
        config.backoff_jitter,
    ) == (0.5, 30.0, 0.2)
    # Without POD_NAMESPACE, the service account's namespace file.
    (service_account / "namespace").write_text("other\n")
    env = {k: v for k, v in CHART_ENV.items() if k != "POD_NAMESPACE"}
    config = KubeWatchConfig.build(env, service_account_dir=service_account)
    assert config is not None and config.namespace == "other"
    assert isinstance(build_scaler(config), KubernetesScaler)


def test_config_outside_a_cluster_is_none(service_account: Path) -> None:
    outside = {k: v for k, v in CHART_ENV.items() if not k.startswith("KUBERNETES_")}
    assert KubeWatchConfig.build(outside, service_account_dir=service_account) is None
    no_statefulset = {k: v for k, v in CHART_ENV.items() if k != "WORKER_STATEFULSET"}
    assert KubeWatchConfig.build(no_statefulset, service_account_dir=service_account) is None
    assert isinstance(build_scaler(None, local_replicas=2), LocalScaler)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"WORKER_SELECTOR": ""}, "WORKER_SELECTOR"),
        ({"WORKER_SELECTOR": "app.kubernetes.io/component!=worker"}, "WORKER_SELECTOR"),
        ({"WORKER_SELECTOR": "component in (worker)"}, "WORKER_SELECTOR"),
        ({"POD_NAMESPACE": ""}, "POD_NAMESPACE"),
    ],
)
def test_config_errors_name_the_variable(
    service_account: Path, changes: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        KubeWatchConfig.build({**CHART_ENV, **changes}, service_account_dir=service_account)


def test_config_without_credentials_says_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="automountServiceAccountToken"):
        KubeWatchConfig.build(CHART_ENV, service_account_dir=tmp_path)


def test_selector_parsing() -> None:
    assert parse_selector("a=1, b==2,c.io/d=") == {"a": "1", "b": "2", "c.io/d": ""}


# --- pieces ----------------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5
    jittered = Backoff(1.0, 8.0, jitter=0.25)
    delays = [jittered.next_delay() for _ in range(4)]
    for delay, full in zip(delays, [1.0, 2.0, 4.0, 8.0], strict=True):
        assert 0.75 * full <= delay <= full
    with pytest.raises(ValueError, match="initial"):
        Backoff(0.0, 1.0)


def test_pod_state_reads_what_the_api_server_writes() -> None:
    pod = _pod_state(
        {
            "metadata": {"name": "podrl-worker-7", "deletionTimestamp": "2026-12-01T10:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.1.0.7", "conditions": []},
        },
        STATEFULSET,
    )
    assert (pod.ordinal, pod.ready, pod.ip, pod.terminating) == (7, False, "10.1.0.7", True)
    assert pod.deletion_timestamp is not None and pod.deletion_timestamp.year == 2026
    # Not named <statefulset>-N; no status yet; an unreadable timestamp still means "deleting".
    odd = _pod_state(
        {"metadata": {"name": "podrl-worker-x", "deletionTimestamp": "soon"}}, STATEFULSET
    )
    assert (odd.ordinal, odd.phase, odd.ip, odd.terminating) == (None, "Pending", None, True)


def test_local_scaler_tells_the_launcher_of_each_change() -> None:
    seen: list[int] = []
    scaler = LocalScaler(1, on_change=seen.append)
    assert isinstance(scaler, ReplicaScaler)
    scaler.set_replicas(3)
    scaler.set_replicas(3)
    scaler.set_replicas(0)
    assert (seen, scaler.desired_replicas()) == ([3, 0], 0)
    for bad in (-1, True, "2", 1.0):
        with pytest.raises(ValueError, match="replicas"):
            check_replicas(bad)


def test_scaler_errors_name_the_statefulset_and_the_fix(
    server: ApiServer, kube: client.ApiClient
) -> None:
    scaler = KubernetesScaler(watch_config(server))
    with pytest.raises(ScaleError, match="WORKER_STATEFULSET") as missing:
        scaler.set_replicas(2)
    assert missing.value.http_status == 404
    with pytest.raises(ValueError, match="replicas"):
        scaler.set_replicas(-1)
    create_statefulset(kube)
    assert server.api is not None
    server.api.forbidden.add(("patch", "statefulsets/scale"))
    with pytest.raises(ScaleError, match="Role must grant") as forbidden:
        scaler.set_replicas(2)
    assert forbidden.value.http_status == 403
    assert scaler.desired_replicas() == 1
    scaler.close()

    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = client.Configuration()
    unreachable.host = f"http://127.0.0.1:{port}"
    unreachable.retries = 0
    scaler = KubernetesScaler(watch_config(server, client_configuration=unreachable))
    with pytest.raises(ScaleError, match="cannot reach") as refused:
        scaler.desired_replicas()
    assert refused.value.http_status is None
    scaler.close()
