"""The authenticating front of the torchft Lighthouse (docs/security.md, "The torchft Lighthouse").

torchft's Lighthouse authenticates nobody, and its one port serves, besides its gRPC service,
an HTTP page listing every replica's manager and TCPStore address and a ``POST
/replica/<id>/kill`` that kills a trainer. So ``podrl-lighthouse`` runs it on loopback only and
serves this front on the public address: a gRPC server that forwards torchft's two
``LighthouseService`` calls the trainers make, Quorum and Heartbeat, as raw bytes, and nothing
else (an HTTP/1 request gets no page; any other method is UNIMPLEMENTED).

torchft's client (Rust) sends no credentials podrl could add, so a trainer authenticates through
its **replica id**: ``<pod>:<mac>`` (:func:`signed_replica_id`), the MAC of the run secret over
the pod and the manager and TCPStore addresses its Quorum request gives; torchft appends
``:<uuid>`` and reads the pod as what precedes the first ``:``. The front decodes each request:

- a Quorum whose replica id does not carry the MAC of its own pod and addresses is refused
  (UNAUTHENTICATED); a valid one admits its replica id;
- a Heartbeat is forwarded only for an admitted replica id (it carries no addresses to check;
  the Quorum that a trainer sends right after it starts admits it).

A replica id copied off the wire (the traffic is plaintext) lets its holder send Quorum and
Heartbeat as that pod, at that pod's own addresses only: it can hold up or abort steps, but it
cannot make a pod heal from, or exchange gradients with, an address of its choosing.

With ``auth.disabled`` there is no secret: every Quorum and Heartbeat is forwarded unchecked
(the dashboard stays on loopback all the same).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from podrl.common.auth import RunSecret

log = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"
#: The health service name the front reports SERVING under (probes of the chart).
HEALTH_SERVICE = SERVICE
#: How many replica ids the front remembers as admitted (each pod start adds one; the oldest go).
MAX_ADMITTED = 4096
# Protobuf field numbers of torchft.proto: LighthouseQuorumRequest.requester,
# QuorumMember.replica_id/address/store_address, LighthouseHeartbeatRequest.replica_id.
_REQUESTER, _REPLICA_ID, _ADDRESS, _STORE_ADDRESS = 1, 1, 2, 3


def signed_replica_id(
    secret: RunSecret | None, pod: str, manager_address: str, store_address: str
) -> str:
    """The replica id a pod's trainer gives torchft: ``<pod>:<mac>``; the pod alone when auth
    is disabled."""
    if secret is None:
        return pod
    return f"{pod}:{secret.replica_mac(pod, manager_address, store_address)}"


class WireError(ValueError):
    """A request that is not the protobuf message it should be."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise WireError("varint longer than 10 bytes")


def length_fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields (strings, messages) of one protobuf message, by number.
    A field given twice is an error: protobuf would merge or overwrite it, and the front must
    check exactly the value the Lighthouse uses."""
    fields: dict[int, bytes] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise WireError(f"field {number} runs past the message's end")
            if number in fields:
                raise WireError(f"field {number} is given more than once")
            fields[number] = data[pos : pos + length]
            pos += length
        else:
            raise WireError(f"unexpected wire type {wire_type} of field {number}")
    if pos != len(data):
        raise WireError("a fixed-size field runs past the message's end")
    return fields


def _text(fields: dict[int, bytes], number: int) -> str:
    try:
        return fields.get(number, b"").decode()
    except UnicodeDecodeError:
        raise WireError(f"field {number} is not UTF-8") from None


class ReplicaGate:
    """Which Quorum and Heartbeat requests carry the run secret's MAC (see the module
    docstring). Thread-safe: the front's handlers run on a thread pool."""

    def __init__(self, secret: RunSecret) -> None:
        self._secret = secret
        self._admitted: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def check_quorum(self, request: bytes) -> str | None:
        """Why this LighthouseQuorumRequest is refused, or None (its replica id is admitted)."""
        member = length_fields(length_fields(request).get(_REQUESTER, b""))
        replica_id = _text(member, _REPLICA_ID)
        address, store = _text(member, _ADDRESS), _text(member, _STORE_ADDRESS)
        pod, _, rest = replica_id.partition(":")
        mac = rest.split(":", 1)[0]
        expected = self._secret.replica_mac(pod, address, store)
        # Constant time, as every MAC check of podrl's.
        if not pod or not hmac.compare_digest(expected.encode(), mac.encode()):
            return (
                f"replica id {replica_id!r} does not carry this run's MAC for pod {pod!r} at "
                f"{address!r} (store {store!r}); only the run's trainers join its quorums"
            )
        with self._lock:
            self._admitted[replica_id] = None
            self._admitted.move_to_end(replica_id)
            while len(self._admitted) > MAX_ADMITTED:
                self._admitted.popitem(last=False)
        return None

    def check_heartbeat(self, request: bytes) -> str | None:
        """Why this LighthouseHeartbeatRequest is refused, or None."""
        replica_id = _text(length_fields(request), _REPLICA_ID)
        with self._lock:
            if replica_id in self._admitted:
                return None
        return (
            f"replica id {replica_id!r} has not joined a quorum with this run's MAC; "
            "only the run's trainers heartbeat"
        )


def _forwarder(
    channel: grpc.Channel, method: str, check: Callable[[bytes], str | None] | None
) -> grpc.RpcMethodHandler:
    # No serializers: the bytes go on as they came, so the Lighthouse parses what was checked.
    call = channel.unary_unary(f"/{SERVICE}/{method}")

    def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
        if check is not None:
            try:
                refusal = check(request)
            except WireError as err:
                log.warning("refused %s from %s: %s", method, context.peer(), err)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {err}")
            if refusal is not None:
                log.warning("refused %s from %s: %s", method, context.peer(), refusal)
                context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        try:
            return call(request, timeout=context.time_remaining())
        except grpc.RpcError as err:
            context.abort(err.code(), err.details() or "")

    return grpc.unary_unary_rpc_method_handler(forward)


def start_front(
    bind: str, lighthouse: str, secret: RunSecret | None, workers: int
) -> tuple[grpc.Server, int]:
    """The front on ``bind``, forwarding to the Lighthouse at ``lighthouse`` (host:port on
    loopback), started; with its port. ``workers`` threads: a Quorum call holds one until its
    quorum forms, so there must be more than pods. Raises OSError when ``bind`` is taken."""
    channel = grpc.insecure_channel(lighthouse)
    gate = ReplicaGate(secret) if secret is not None else None
    handlers = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Quorum": _forwarder(channel, "Quorum", gate.check_quorum if gate else None),
            "Heartbeat": _forwarder(channel, "Heartbeat", gate.check_heartbeat if gate else None),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        handlers=[handlers],
        # Without it grpc binds a port another process holds (SO_REUSEPORT), sharing it.
        options=[("grpc.so_reuseport", 0)],
    )
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as err:  # grpcio raises RuntimeError for a port it cannot bind
        raise OSError(str(err)) from None
    if port == 0:
        raise OSError(f"cannot bind {bind}")
    server.start()
    for name in ("", HEALTH_SERVICE):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port
