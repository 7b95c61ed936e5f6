"""``podrl-lighthouse`` serves the trainers only through its authenticating front: the torchft
Lighthouse listens on loopback, and its HTTP page, its kill endpoint and quorum joins without
the run secret's MAC in the replica id are not served to anyone who reaches the public port
(real process, real torchft client)."""

from __future__ import annotations

import re
from datetime import timedelta

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torchft.coordination import LighthouseClient

from podrl.common.auth import load_run_secret
from podrl.config.auth import AuthConfig
from podrl.trainer.lighthouse_front import signed_replica_id
from tests.trainer.pods import start_lighthouse

TIMEOUT = timedelta(seconds=10)
# torchft's client raises the gRPC status as text.
REFUSED = r"UNAUTHENTICATED|Unauthenticated"


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    server = start_lighthouse(tmp_path_factory.mktemp("lighthouse-front"), auth=True)
    yield server
    server.stop()


def _client(address: str) -> LighthouseClient:
    return LighthouseClient(f"http://{address}", connect_timeout=TIMEOUT)


def _join(address: str, replica_id: str, manager: str, store: str, step: int = 0):
    return _client(address).quorum(
        replica_id=replica_id,
        address=manager,
        store_address=store,
        step=step,
        world_size=1,
        shrink_only=False,
        timeout=TIMEOUT,
    )


def test_the_torchft_lighthouse_listens_on_loopback_only(lighthouse) -> None:
    host, _, port = lighthouse.server_address.rpartition(":")
    assert host == "127.0.0.1" and port != lighthouse.address.rpartition(":")[2]
    # Its own page answers there (an operator inside the pod may read it), not on the front.
    assert "Quorum" in lighthouse.status()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/"), ("GET", "/status"), ("POST", "/replica/local-0:x:y/kill")],
)
def test_the_front_serves_no_page_and_no_kill_endpoint(lighthouse, method, path) -> None:
    """An HTTP/1 request gets no HTTP response from the front, which speaks only gRPC's
    HTTP/2 (torchft's server answered with its page, or with its kill's result)."""
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.request(method, f"http://{lighthouse.address}{path}", timeout=10)


def test_a_quorum_join_without_the_runs_mac_is_refused(lighthouse) -> None:
    """An outsider's torchft client cannot join a quorum or heartbeat: its replica id carries
    no MAC, a made-up one, or a real pod's MAC with other addresses (a copied id)."""
    secret = load_run_secret(AuthConfig())
    assert secret is not None
    manager, store = "http://127.0.0.1:9", "127.0.0.1:9"
    copied = signed_replica_id(secret, "local-0", "http://10.0.0.5:1234", "10.0.0.5:1235")
    for replica_id in ("local-7:evil", "local-7", f"local-7:{'0' * 64}", f"{copied}:uuid"):
        with pytest.raises(Exception, match=REFUSED) as refused:
            _join(lighthouse.address, replica_id, manager, store, step=10**6)
        assert "only the run's trainers join its quorums" in str(refused.value)
        with pytest.raises(Exception, match=REFUSED):
            _client(lighthouse.address).heartbeat(replica_id)
    status = lighthouse.status()
    assert "local-7" not in status and "127.0.0.1:9" not in status
    log = lighthouse.log_path.read_text()
    assert re.search(r"refused Quorum from .*local-7:evil", log), log


def test_a_replica_id_with_the_runs_mac_joins_and_then_heartbeats(lighthouse) -> None:
    """What a trainer sends: ``<pod>:<mac>:<torchft's uuid>`` at the addresses the MAC covers."""
    secret = load_run_secret(AuthConfig())
    assert secret is not None
    manager, store = "http://127.0.0.1:41000", "127.0.0.1:41001"
    replica_id = f"{signed_replica_id(secret, 'local-3', manager, store)}:uuid-1"
    client = _client(lighthouse.address)
    # Before its quorum, the front knows no such replica: no heartbeat.
    with pytest.raises(Exception, match=REFUSED):
        client.heartbeat(replica_id)
    quorum = _join(lighthouse.address, replica_id, manager, store)
    assert [p.replica_id for p in quorum.participants] == [replica_id]
    client.heartbeat(replica_id)
    # A copy of that id at another manager address is still refused.
    with pytest.raises(Exception, match=REFUSED):
        _join(lighthouse.address, replica_id, "http://127.0.0.1:9", store)


def test_the_front_forwards_only_quorum_and_heartbeat_and_refuses_malformed_requests(
    lighthouse,
) -> None:
    with grpc.insecure_channel(lighthouse.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="torchft.LighthouseService"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # torchft's other Lighthouse methods (and anything else) are not served.
        with pytest.raises(grpc.RpcError) as other:
            channel.unary_unary("/torchft.LighthouseService/GetConfig")(b"", timeout=10)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
        quorum = channel.unary_unary("/torchft.LighthouseService/Quorum")
        # Not protobuf; a replica id given twice (protobuf would keep the last, unchecked one).
        member = b"\x0a\x07local-0" + b"\x0a\x07local-1"
        for request in (b"\xff\xff", b"\x0a" + bytes([len(member)]) + member):
            with pytest.raises(grpc.RpcError) as malformed:
                quorum(request, timeout=10)
            assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed request" in malformed.value.details()
