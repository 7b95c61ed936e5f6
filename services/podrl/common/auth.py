"""What every RPC passes through: authentication and least privilege (the trust model:
docs/security.md), and the RPC metrics.

The **run secret** authenticates the run: only the run's own services hold it
(``PODRL_RUN_SECRET_FILE`` or ``PODRL_RUN_SECRET``, see ``podrl.config.auth``). It never goes
over the wire. Each client says who it is — a **role** (controller, generator, grader, trainer)
and its **worker id** — and signs that claim with an HMAC keyed by the secret; the three values
travel as gRPC metadata on every call (:class:`CallerCredentials`, attached by the channel
factory ``podrl.common.grpc_options.open_channel``).

Every server checks them in one interceptor (:class:`AuthServerInterceptor`, installed by
``podrl.common.service``) before the request is even parsed:

- ``grpc.health.v1.Health`` and server reflection are open (kubelet probes, ``grpc_health_probe``);
- a call without the metadata, or with a MAC that does not match, gets ``UNAUTHENTICATED``, and
  the refused peer is logged;
- a call to a method in :data:`CONTROLLER_ONLY` from any role but the controller gets
  ``PERMISSION_DENIED``;
- otherwise the handler runs with :func:`current_caller` naming the verified caller, so a
  servicer can check what depends on the request (the controller's Register, Heartbeat and Drain
  accept a worker only as itself).

With ``auth.disabled`` there is no secret: nothing is checked and :func:`current_caller` is None.

The controller's REST API takes the same kind of claim for the calls that change the run
(``PUT /v1/workers/replicas``): a **bearer token** ``<role>.<worker id>.<mac>``
(:meth:`RunSecret.rest_token`, checked by :meth:`RunSecret.verify_rest_token`), signed the same way
with a key of its own purpose, so that a REST token is never a gRPC credential nor the other
way round. Its roles add :data:`OPERATOR`, a person or tool (``podrl scale``) outside the run.

Every server also counts and times each call (:class:`MetricsInterceptor`, installed before the
auth check so that refused calls are counted too), so the server interceptors of every service,
the auth check and the metrics, are this one file.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from prometheus_client import Counter, Gauge, Histogram

from podrl.config.auth import MIN_SECRET_CHARS, SECRET_FILE_ENV, SECRET_VALUE_ENV, AuthConfig
from podrl.config.loading import ConfigError

log = logging.getLogger(__name__)

ROLES = ("controller", "generator", "grader", "trainer")
CONTROLLER = "controller"
#: A person or tool acting on the run from outside it (``podrl scale``): REST tokens only.
OPERATOR = "operator"
#: Roles a REST bearer token may claim.
REST_ROLES = (*ROLES, OPERATOR)
#: Who may change the run through REST (scale it): the operator, and the controller itself.
REST_CHANGE_ROLES = frozenset({OPERATOR, CONTROLLER})

#: Metadata keys of a caller's claim (gRPC metadata keys are lower case).
ROLE_KEY = "podrl-role"
WORKER_ID_KEY = "podrl-worker-id"
MAC_KEY = "podrl-mac"

#: A worker id: a Kubernetes pod name, a host name, ``local-0`` (DNS-label characters, dots and
#: underscores; 1 to 253 characters, the longest pod name).
MAX_WORKER_ID_CHARS = 253
_WORKER_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")

#: Open to every caller: health (kubelet probes, ``podrl.tools.check_health``) and reflection.
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

#: Methods only the controller may call: they change what is trained, served or stored, or
#: play an episode (the episode runner is the controller's).
CONTROLLER_ONLY = frozenset(
    {
        "/podrl.v1.Trainer/Train",
        "/podrl.v1.Trainer/PublishWeights",
        "/podrl.v1.Trainer/AcknowledgeWeights",
        "/podrl.v1.Trainer/SaveCheckpoint",
        "/podrl.v1.Trainer/LoadCheckpoint",
        "/podrl.v1.Trainer/ExportHF",
        "/podrl.v1.Generator/ApplyWeights",
        "/podrl.v1.Generator/Sleep",
        "/podrl.v1.Generator/WakeUp",
        "/podrl.v1.Environment/Reset",
        "/podrl.v1.Environment/Step",
        "/podrl.v1.Environment/Close",
    }
)

_CALLER_MAC_PURPOSE = "podrl rpc caller v1"
#: Another purpose, another key: a REST token (it may sit in a shell's history or a proxy's
#: log) must not also sign gRPC calls, and the gRPC metadata must not open the REST API.
_REST_TOKEN_PURPOSE = "podrl rest bearer v1"
#: The MAC in a trainer's torchft replica id (podrl.trainer.lighthouse_front): never a call's
#: credential, since a replica id is sent to the Lighthouse and handed to every peer pod.
_REPLICA_PURPOSE = "podrl lighthouse replica v1"


def worker_id_problem(worker_id: str) -> str | None:
    """Why ``worker_id`` cannot name a worker, or None when it can."""
    if not worker_id:
        return "must not be empty"
    if len(worker_id) > MAX_WORKER_ID_CHARS:
        return f"is {len(worker_id)} characters long; at most {MAX_WORKER_ID_CHARS} are allowed"
    if not _WORKER_ID.fullmatch(worker_id):
        return (
            f"{worker_id!r} may hold only letters, digits, '.', '_' and '-', and must start and "
            "end with a letter or digit"
        )
    return None


@dataclass(frozen=True)
class RunSecret:
    """The run's shared secret. Its value is never logged or printed (``repr`` hides it)."""

    value: bytes = field(repr=False)
    source: str
    """Where it came from (a variable name, a file), for messages."""

    def key(self, purpose: str) -> bytes:
        """A key for one purpose, derived from the secret (HMAC-SHA256), so that a value made
        for one purpose is never valid for another."""
        return hmac.new(self.value, purpose.encode(), hashlib.sha256).digest()

    def caller_mac(self, role: str, worker_id: str) -> str:
        return self._claim_mac(_CALLER_MAC_PURPOSE, role, worker_id)

    def rest_token(self, role: str, worker_id: str) -> str:
        """The bearer token of ``role`` as ``worker_id`` for the controller's REST API:
        ``<role>.<worker_id>.<hex HMAC-SHA256 over role \\0 worker_id>``, keyed for REST only."""
        if role not in REST_ROLES:
            raise ValueError(f"role must be one of {', '.join(REST_ROLES)} (got {role!r})")
        problem = worker_id_problem(worker_id)
        if problem:
            raise ValueError(f"worker_id {problem}")
        return f"{role}.{worker_id}.{self._claim_mac(_REST_TOKEN_PURPOSE, role, worker_id)}"

    def verify_rest_token(self, token: str) -> Caller | str:
        """The caller a REST bearer token names, or why it is refused (malformed, or not
        signed with this secret). Roles never contain '.' and the MAC is hex, so the worker id
        is what lies between the first and the last dot (worker ids may hold dots)."""
        role, _, rest = token.partition(".")
        worker_id, _, mac = rest.rpartition(".")
        if not role or not worker_id or not mac:
            return "the token is not of the form <role>.<worker id>.<mac>"
        expected = self._claim_mac(_REST_TOKEN_PURPOSE, role, worker_id)
        # Constant time, as for the gRPC claim.
        if not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "replace")):
            return "the token does not match this run's secret"
        if role not in REST_ROLES:  # a MAC made with the secret cannot name another role
            return f"unknown role {role!r}"
        return Caller(role, worker_id)

    def replica_mac(self, pod: str, manager_address: str, store_address: str) -> str:
        """The MAC a pod's torchft replica id carries: over the pod and the two addresses the
        Lighthouse hands its peers (its manager server, its TCPStore), so that a copied replica
        id names no other address than the pod's own."""
        message = f"{pod}\0{manager_address}\0{store_address}".encode()
        return hmac.new(self.key(_REPLICA_PURPOSE), message, hashlib.sha256).hexdigest()

    def _claim_mac(self, purpose: str, role: str, worker_id: str) -> str:
        message = f"{role}\0{worker_id}".encode()
        return hmac.new(self.key(purpose), message, hashlib.sha256).hexdigest()


def _checked_secret(text: str, source: str) -> RunSecret:
    value = text.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{source}: the run secret is {len(value)} characters long; at least "
            f"{MIN_SECRET_CHARS} are required (e.g. `openssl rand -hex 32`)"
        )
    return RunSecret(value.encode(), source)


#: A secret file holds the secret and a newline; anything much larger is not one.
_MAX_SECRET_FILE_BYTES = 4096
#: Kubernetes' secret volumes (and projected ones) present each key as a symlink into the
#: volume's current version: ``<key> -> ..data/<key>``, ``..data -> ..<timestamp>``.
_VOLUME_DATA = "..data"


def _secret_volume_file(link: Path) -> Path | None:
    """The file a Kubernetes secret volume's symlink ``link`` stands for, when ``link`` is
    exactly that layout and stays inside its own folder; else None."""
    if os.readlink(link) != f"{_VOLUME_DATA}/{link.name}":
        return None
    try:
        version = os.readlink(link.parent / _VOLUME_DATA)
        if "/" in version or not version.startswith("..") or version in ("..", _VOLUME_DATA):
            return None
        if not stat.S_ISDIR(os.lstat(link.parent / version).st_mode):
            return None
    except OSError:  # no ..data link, or it names nothing
        return None
    return link.parent / version / link.name


def read_secret_file(path: Path) -> str:
    """The text of the run secret file ``path``, held to the weights key file's rules: a
    regular file, not a symlink, that grants nothing to group or others (``podrl up`` writes
    it 0600). One layout is accepted besides: a Kubernetes secret volume, whose key is a
    symlink to ``..data/<key>`` in the same folder and whose file may be read by its group (the
    pod's fsGroup; the chart mounts it 0440). Raises ConfigError naming the variable and the
    fix otherwise: a secret that others can read, or a link to another file (``/etc/passwd``),
    would authenticate whoever else can read it."""
    where = f"{SECRET_FILE_ENV}={path}"
    try:
        in_volume = False
        if stat.S_ISLNK(os.lstat(path).st_mode):
            real = _secret_volume_file(path)
            if real is None:
                raise ConfigError(
                    f"{where}: is a symlink (to {os.readlink(path)}); symlinks are not followed. "
                    "Point it at the secret file itself, a regular file with mode 0600 (a "
                    "Kubernetes secret volume's own links are accepted: docs/security.md)"
                )
            path, in_volume = real, True
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            text = os.read(fd, _MAX_SECRET_FILE_BYTES + 1) if stat.S_ISREG(info.st_mode) else b""
        finally:
            os.close(fd)
    except OSError as err:
        raise ConfigError(
            f"{where}: cannot read the run secret ({err.strerror or err}); point it at a "
            "readable file"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{where}: cannot read the run secret: it is not a regular file")
    allowed = 0o040 if in_volume else 0  # a secret volume's group is the pod's fsGroup
    if stat.S_IMODE(info.st_mode) & 0o077 & ~allowed:
        rule = (
            "nothing to others and only read to its group (the volume's defaultMode: 0440)"
            if in_volume
            else "nothing to group or others (chmod 600)"
        )
        raise ConfigError(
            f"{where}: has mode {stat.S_IMODE(info.st_mode):o}; the run secret file must grant "
            f"{rule}"
        )
    if len(text) > _MAX_SECRET_FILE_BYTES:
        raise ConfigError(
            f"{where}: is larger than {_MAX_SECRET_FILE_BYTES} bytes; it must hold the run "
            "secret only (e.g. `openssl rand -hex 32`)"
        )
    try:
        return text.decode()
    except UnicodeDecodeError:
        raise ConfigError(
            f"{where}: cannot read the run secret (not UTF-8 text); write it as text, e.g. "
            "`openssl rand -hex 32`"
        ) from None


def load_run_secret(config: AuthConfig, env: Mapping[str, str] | None = None) -> RunSecret | None:
    """The run secret from ``PODRL_RUN_SECRET_FILE`` or ``PODRL_RUN_SECRET``; None when
    ``auth.disabled``. Raises ConfigError naming the variable when it is missing, unreadable,
    too short, or given both ways."""
    env = os.environ if env is None else env
    path, value = env.get(SECRET_FILE_ENV), env.get(SECRET_VALUE_ENV)
    if config.disabled:
        if path or value:
            log.warning("auth.disabled is true: the run secret is ignored; RPCs are open")
        return None
    if path and value is not None:
        raise ConfigError(
            f"{SECRET_FILE_ENV} and {SECRET_VALUE_ENV} are both set; set only one of them"
        )
    if path:
        return _checked_secret(read_secret_file(Path(path)), f"{SECRET_FILE_ENV}={path}")
    if value is not None:
        return _checked_secret(value, SECRET_VALUE_ENV)
    raise ConfigError(
        f"no run secret: set {SECRET_FILE_ENV} to a file holding the run's secret (podrl "
        f"up/run and the Helm chart do this), or {SECRET_VALUE_ENV} to the secret itself; "
        "to run without authentication set auth.disabled: true (PODRL_AUTH__DISABLED=true)"
    )


class Caller(NamedTuple):
    """Who made a call, as its verified claim says."""

    role: str
    worker_id: str


@dataclass(frozen=True)
class CallerCredentials:
    """What a client attaches to every call: its role, its worker id and their MAC."""

    secret: RunSecret
    role: str
    worker_id: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (got {self.role!r})")
        problem = worker_id_problem(self.worker_id)
        if problem:
            raise ConfigError(f"worker_id (PODRL_WORKER_ID) {problem}")

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            (ROLE_KEY, self.role),
            (WORKER_ID_KEY, self.worker_id),
            (MAC_KEY, self.secret.caller_mac(self.role, self.worker_id)),
        )

    @classmethod
    def for_role(
        cls,
        role: str,
        worker_id: str,
        config: AuthConfig,
        env: Mapping[str, str] | None = None,
    ) -> CallerCredentials | None:
        """Credentials from the run secret in ``env``; None when ``auth.disabled``."""
        secret = load_run_secret(config, env)
        return None if secret is None else cls(secret, role, worker_id)


# ---- client side ---------------------------------------------------------------------------


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Sequence[tuple[str, str]] | None),
            ("credentials", grpc.CallCredentials | None),
            ("wait_for_ready", bool | None),
            ("compression", grpc.Compression | None),
        ],
    ),
    grpc.ClientCallDetails,
):
    """The call's details with the claim added (grpc reads these six fields)."""


class AuthClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the caller's claim to every call of a channel."""

    def __init__(self, credentials: CallerCredentials) -> None:
        self._metadata = credentials.metadata()

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), *self._metadata],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return continuation(self._details(client_call_details), request)


# ---- server side ---------------------------------------------------------------------------

_CURRENT_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "podrl_caller", default=None
)


def current_caller() -> Caller | None:
    """The verified caller of the RPC this thread is handling; None when auth is disabled."""
    return _CURRENT_CALLER.get()


def _refusal(code: grpc.StatusCode, message: str, method: str) -> grpc.RpcMethodHandler:
    def refuse(_request: bytes, context: grpc.ServicerContext) -> None:
        log.warning("refused %s from %s: %s (%s)", method, context.peer(), message, code.name)
        context.abort(code, message)

    # No deserializer: a refused request is never parsed (the bytes are dropped as they came).
    return grpc.unary_unary_rpc_method_handler(refuse)


class AuthServerInterceptor(grpc.ServerInterceptor):
    """Checks the caller's claim on every RPC (see the module docstring)."""

    def __init__(self, secret: RunSecret | None) -> None:
        self._secret = secret

    def _verify(self, metadata: Sequence[tuple[str, Any]] | None) -> Caller | str:
        """The caller, or why it is refused."""
        claim: dict[str, str] = {}
        for key, value in metadata or ():
            if key in (ROLE_KEY, WORKER_ID_KEY, MAC_KEY):
                if key in claim:
                    return f"metadata {key} is given more than once"
                claim[key] = value if isinstance(value, str) else ""
        if MAC_KEY not in claim:
            return "no run credentials (the call must carry the run secret's MAC)"
        role, worker_id = claim.get(ROLE_KEY, ""), claim.get(WORKER_ID_KEY, "")
        assert self._secret is not None
        expected = self._secret.caller_mac(role, worker_id)
        # Constant time: a timing difference must not reveal how much of a MAC was right.
        if not hmac.compare_digest(expected.encode(), claim[MAC_KEY].encode()):
            return "the run credentials do not match this run's secret"
        if role not in ROLES:  # a MAC made with the secret cannot name another role: defensive
            return f"unknown role {role!r}"
        return Caller(role, worker_id)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if self._secret is None or method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        caller = self._verify(handler_call_details.invocation_metadata)
        if isinstance(caller, str):
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, caller, method)
        if method in CONTROLLER_ONLY and caller.role != CONTROLLER:
            return _refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"only the controller may call {method.rsplit('/', 1)[-1]} "
                f"(caller: {caller.role} of {caller.worker_id})",
                method,
            )
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # unknown method (UNIMPLEMENTED); podrl has only unary RPCs
        behavior = handler.unary_unary

        def as_caller(request: Any, context: grpc.ServicerContext) -> Any:
            token = _CURRENT_CALLER.set(caller)
            try:
                return behavior(request, context)
            finally:
                _CURRENT_CALLER.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            as_caller,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# ---- server side: the RPC metrics ----------------------------------------------------------

RPC_STARTED = Counter(
    "podrl_grpc_server_started_total", "RPCs received.", ["grpc_service", "grpc_method"]
)
RPC_HANDLED = Counter(
    "podrl_grpc_server_handled_total",
    "RPCs completed, by status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
RPC_SECONDS = Histogram(
    "podrl_grpc_server_handling_seconds",
    "RPC handling time.",
    ["grpc_service", "grpc_method"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60, 300),
)
RPC_IN_FLIGHT = Gauge("podrl_grpc_server_in_flight", "RPCs being handled now.")


def _split_method(full_method: str) -> tuple[str, str]:
    # "/podrl.v1.Generator/Generate" → ("podrl.v1.Generator", "Generate")
    _, service, method = full_method.split("/", 2)
    return service, method


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every unary RPC by service, method and final status code."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        service, method = _split_method(handler_call_details.method)
        behavior = handler.unary_unary

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            RPC_STARTED.labels(service, method).inc()
            RPC_IN_FLIGHT.inc()
            start = time.perf_counter()
            code = "UNKNOWN"
            try:
                response = behavior(request, context)
                code = (context.code() or grpc.StatusCode.OK).name
                return response
            except Exception:
                code = (context.code() or grpc.StatusCode.UNKNOWN).name
                raise
            finally:
                RPC_IN_FLIGHT.dec()
                RPC_SECONDS.labels(service, method).observe(time.perf_counter() - start)
                RPC_HANDLED.labels(service, method, code).inc()

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
