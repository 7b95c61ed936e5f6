"""Trainers of two pods with the run secret, through ``podrl-lighthouse``'s front (real
processes, torchft, gRPC), in file order on the same processes:

1. a step split between the pods trains: their replica ids carry the MAC, the front admits them;
2. the Lighthouse's kill endpoint, asked on the public port for a pod's replica, is not served:
   the pod's trainer stays and trains the next step;
3. an outsider that joins the torchft Lighthouse itself (as if it had got past the front) with
   a high step, so that the pods would heal from it: the pods refuse every quorum that holds
   it (a pod the request does not name), never heal, and train once it is gone.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from datetime import timedelta

import grpc
import httpx
import pytest
from torchft.coordination import LighthouseClient

from podrl.common.auth import CallerCredentials, load_run_secret
from podrl.config.auth import AuthConfig
from tests.trainer.pods import Pod, share, start_lighthouse, start_pods, train_together
from tests.trainer.rank_worker import make_request

pytestmark = pytest.mark.slow

SEQUENCES = 4
PODS = ["pod-0", "pod-1"]
# A quorum that keeps an outsider is given up on within seconds, not the tests' minute.
QUORUM_TIMEOUT = {"PODRL_TRAINER__REPLICATION__QUORUM_TIMEOUT_SECONDS": "8"}


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lighthouse-pods")
    lighthouse = start_lighthouse(tmp, auth=True)
    secret = load_run_secret(AuthConfig())
    assert secret is not None
    pods = start_pods(
        tiny_model,
        tmp,
        PODS,
        lighthouse=lighthouse.address,
        credentials=CallerCredentials(secret, "controller", "controller-0"),
        extra_env=dict.fromkeys(PODS, QUORUM_TIMEOUT),
    )
    yield lighthouse, [pods[name] for name in PODS]
    for pod in pods.values():
        pod.kill()
    lighthouse.stop()


def _step(pods: list[Pod], version: int, tag: str) -> dict[str, object]:
    """Train a batch split over ``pods`` at once; each pod's reply or RpcError, by name."""
    batch = make_request(20 + version, sequences=SEQUENCES, version=version)
    halves = [range(0, SEQUENCES // 2), range(SEQUENCES // 2, SEQUENCES)]
    requests = {
        pod: share(batch, part, f"{tag}@{pod.name}", len(pods), PODS)
        for pod, part in zip(pods, halves, strict=True)
    }
    return train_together(requests, timeout=120)


def _trained(replies: dict[str, object], version: int) -> None:
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    assert {r.policy_version for r in replies.values()} == {version}


def test_two_pods_with_the_run_secret_train_through_the_front(run) -> None:
    lighthouse, pods = run
    _trained(_step(pods, 0, "1"), 1)
    # The torchft Lighthouse knows them by replica ids that carry the MAC.
    status = lighthouse.status()
    for pod in PODS:
        assert re.search(rf"{pod}:[0-9a-f]{{64}}:", status), status


def test_the_kill_endpoint_is_not_served_and_the_trainer_stays(run) -> None:
    lighthouse, pods = run
    replica = re.search(r"pod-0:[0-9a-f]{64}:[0-9a-f-]{36}", lighthouse.status())
    assert replica, lighthouse.status()
    with contextlib.suppress(httpx.HTTPError):  # no response: the front speaks gRPC only
        httpx.post(f"http://{lighthouse.address}/replica/{replica.group(0)}/kill", timeout=10)
    time.sleep(2)  # the kill, were it served, reaches the pod's manager within this
    assert pods[0].process.poll() is None, pods[0].log()
    assert "killed from dashboard" not in pods[0].log()
    _trained(_step(pods, 1, "2"), 2)


def test_the_pods_never_heal_from_a_replica_their_request_does_not_name(run) -> None:
    lighthouse, pods = run
    # Straight to the torchft Lighthouse: what the front would refuse, the trainers refuse too.
    client = LighthouseClient(
        f"http://{lighthouse.server_address}", connect_timeout=timedelta(seconds=10)
    )
    stop = threading.Event()

    def outsider() -> None:
        while not stop.is_set():
            client.heartbeat("evil-7:x")
            with contextlib.suppress(Exception):  # no quorum within the timeout: ask again
                client.quorum(
                    replica_id="evil-7:x",
                    address="http://127.0.0.1:9",
                    store_address="127.0.0.1:9",
                    step=10**6,  # the most advanced: every pod would heal from it
                    world_size=1,
                    shrink_only=False,
                    timeout=timedelta(seconds=0.5),
                )

    thread = threading.Thread(target=outsider, daemon=True)
    thread.start()
    try:
        replies = _step(pods, 2, "3")
    finally:
        stop.set()
        thread.join(timeout=10)
    for pod in pods:
        reply = replies[pod.name]
        assert isinstance(reply, grpc.RpcError), reply
        assert reply.code() == grpc.StatusCode.ABORTED, reply.details()
        assert "'evil-7'" in reply.details() and "TrainRequest.pod_ids" in reply.details()
        log = pod.log()
        assert "evil-7" in log and "forming the quorum again" in log
        # torchft's manager server saw the heal it would need; torchft's Python side never
        # asked the outsider's address for a checkpoint, and nothing was loaded.
        assert "healing is required" in log
        assert "fetching checkpoint" not in log and "healed from a peer pod" not in log
        assert pod.digest().policy_version == 2  # nothing healed, nothing stepped
    time.sleep(2)  # the outsider's heartbeat expires (1 s): it leaves the quorums
    _trained(_step(pods, 2, "3-again"), 3)
