"""A call longer than the servers' ping policy window is not cut by the clients' keepalive
(docs/config.md, "gRPC transport"): a real gRPC server made with podrl's server options and a
client channel made by podrl's channel factory, with the keepalive interval shrunk through the
config so that a few seconds hold many pings."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from podrl.common.grpc_options import channel_options, open_channel, server_options
from podrl.config.transport import GrpcConfig

#: One ping a second; the call lasts long enough for gRPC's default policy to end the
#: connection (a third early ping, about 4 s in).
CONFIG = GrpcConfig(keepalive_seconds=1.0, keepalive_timeout_seconds=1.0)
CALL_SECONDS = 8.0
METHOD = "/podrl.test.Slow/Call"


def _serve(options: list[tuple[str, int]]) -> tuple[grpc.Server, str]:
    def call(request: bytes, _context: grpc.ServicerContext) -> bytes:
        time.sleep(CALL_SECONDS)  # a long Train: nothing is sent meanwhile, only pings
        return b"done:" + request

    handler = grpc.method_handlers_generic_handler(
        "podrl.test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler], options=options)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _long_call(address: str, outcome: dict[str, object]) -> None:
    with open_channel(address, CONFIG, None) as channel:
        try:
            outcome["reply"] = channel.unary_unary(METHOD)(b"x", timeout=CALL_SECONDS * 4)
        except grpc.RpcError as err:
            outcome["error"] = (err.code(), err.details())


def test_a_long_call_ends_by_its_own_result_not_by_too_many_pings() -> None:
    """Beside it, the same call to a server with gRPC's default ping policy (the options
    podrl's servers had before) is ended with UNAVAILABLE: the test sees the difference."""
    without_policy = [*channel_options(CONFIG), ("grpc.so_reuseport", 0)]
    servers = [_serve(server_options(CONFIG)), _serve(without_policy)]
    outcomes: list[dict[str, object]] = [{}, {}]
    calls = [
        threading.Thread(target=_long_call, args=(address, outcome))
        for (_, address), outcome in zip(servers, outcomes, strict=True)
    ]
    try:
        for call in calls:
            call.start()
        for call in calls:
            call.join(CALL_SECONDS * 5)
    finally:
        for server, _ in servers:
            server.stop(0)
    podrl, default = outcomes
    assert podrl == {"reply": b"done:x"}, podrl
    assert default.get("error", (None,))[0] == grpc.StatusCode.UNAVAILABLE, default


def test_a_client_pinging_faster_than_the_policy_is_still_cut() -> None:
    """The policy still guards the server: a server configured for a ping every 4 s accepts
    one every 2 s; a client pinging every second is cut at its third early ping."""
    server, address = _serve(server_options(GrpcConfig(keepalive_seconds=4.0)))
    try:
        with open_channel(address, CONFIG, None) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(METHOD)(b"x", timeout=CALL_SECONDS * 4)
    finally:
        server.stop(0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "ping" in (err.value.details() or "").lower()
    assert time.monotonic() - started < CALL_SECONDS


@pytest.mark.parametrize("seconds", [0.5, 7201.0])
def test_the_keepalive_interval_is_bounded(seconds: float) -> None:
    with pytest.raises(ValueError, match="keepalive_seconds"):
        GrpcConfig(keepalive_seconds=seconds)
