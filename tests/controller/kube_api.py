"""A Kubernetes API server for the watch tests: kmock's emulator over real HTTP on loopback.

kmock's ``KubernetesEmulator`` stores objects and serves create, patch, delete, get, list and
watch over HTTP, so the official ``kubernetes`` client and the real ``kubectl`` binary talk to
it as to an API server. It lacks the few API-server behaviours a list-watch depends on; this
module adds each, no bigger than the tests need, behind the same HTTP API:

- **resourceVersion.** Every write gets the next number in ``metadata.resourceVersion``, a
  list carries the current number, and a watch from resourceVersion N replays the writes
  after N, then follows new ones (kmock's own watch starts with every object as ADDED and
  ignores resourceVersion, which would hide a watcher that loses its place).
- **410 Gone.** :meth:`EmulatedKubeAPI.compact` forgets the history so far, as etcd
  compaction does; a watch from an older resourceVersion then gets the ERROR event with code
  410 that a real API server sends.
- **The scale subresource.** GET, PUT and PATCH of ``statefulsets/{name}/scale`` read and store
  ``spec.replicas`` of the emulated StatefulSet, as an autoscaling/v1 Scale; the store is an
  ordinary write (new resourceVersion, a MODIFIED event for watchers). Discovery names the
  subresource's kind as the API server does (autoscaling/v1 Scale), which ``kubectl scale``
  needs to encode its request.
- **Faults.** ``drop_watches`` aborts open watch connections (the client sees the stream end
  mid-chunk); ``hold_watches`` parks new watch requests until ``release_watches``, so a test
  can change objects while a watcher is disconnected; ``fail_watches`` answers the next watch
  requests with 503; ``stall_watches`` makes new watches silent and endless (a half-open
  connection); ``forbidden`` answers chosen verbs 403, as RBAC would.

Like kmock, it does not filter by labelSelector or fieldSelector: the watcher must filter
what it receives itself, and the tests check that it does.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering  # the parsed request type; not re-exported at the top
from kubernetes import client

T = TypeVar("T")

PODS = "v1/pods"
STATEFULSETS = "apps/v1/statefulsets"
_WRITES = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
_VERBS_BY_METHOD = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


@dataclass(frozen=True)
class ApiCall:
    """One request as RBAC sees it: which verb on which (group, resource[/subresource])."""

    user_agent: str
    verb: str
    group: str
    resource: str
    params: dict[str, str]
    content_type: str


@dataclass(frozen=True)
class _Event:
    resource_version: int
    resource: kmock.resource
    namespace: str | None
    type: str
    object: dict[str, Any]


@dataclass(eq=False)
class _OpenWatch:
    request: rendering.Request
    dropped: bool = False
    following: bool = False


@attrs.define(kw_only=True)
class EmulatedKubeAPI(kmock.KubernetesEmulator):
    """kmock's emulator plus resourceVersions, 410 Gone, ``/scale`` and injected faults."""

    _resource_version: int = attrs.field(default=0, init=False)
    _compacted_to: int = attrs.field(default=0, init=False)
    _history: list[_Event] = attrs.field(factory=list, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _open_watches: set[_OpenWatch] = attrs.field(factory=set, init=False)
    _holding: bool = attrs.field(default=False, init=False)
    _failing_watches: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Watch requests parked by :meth:`hold_watches`, by resource plural.
    held: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Watches open and following new writes, by resource plural.
    following: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Watches answered with 410 Gone, by resource plural.
    gone_answers: Counter[str] = attrs.field(factory=Counter, init=False)
    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    #: (verb, resource[/subresource]) answered 403 Forbidden, as RBAC would.
    forbidden: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    #: While set, every watch from a resourceVersion is answered 410 Gone.
    expire_watches: bool = attrs.field(default=False, init=False)
    #: While set, new watches ignore timeoutSeconds and send nothing: a stalled connection.
    stall_watches: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources[PODS] = kmock.ResourceInfo(
            kind="Pod",
            singular="pod",
            namespaced=True,
            verbs={"create", "delete", "get", "list", "patch", "watch"},
        )
        self.resources[STATEFULSETS] = kmock.ResourceInfo(
            kind="StatefulSet",
            singular="statefulset",
            shortnames={"sts"},
            namespaced=True,
            verbs={"create", "delete", "get", "list", "patch", "watch"},
            subresources={"scale", "status"},
        )

    # --- requests -------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or not request.resource.plural:  # discovery, /version
            return await super()._handle(request)
        call = self._record_call(request)
        plural = request.resource.plural or ""
        if (call.verb, call.resource) in self.forbidden:
            return await self._render_error(
                kmock.KubernetesError(403, "Forbidden", f"{call.verb} {call.resource}: no")
            )
        if request.action == kmock.action.WATCH and self._failing_watches[plural] > 0:
            self._failing_watches[plural] -= 1
            return await self._render_error(
                kmock.KubernetesError(503, "ServiceUnavailable", "injected by the test")
            )
        if request.subresource == "scale":
            return await self._handle_scale(request)
        if request.action in _WRITES and request.subresource in (None, "status"):
            store = functools.partial(kmock.KubernetesEmulator._handle, self, request)
            return await self._write(self._key(request), store)
        return await super()._handle(request)

    def _record_call(self, request: rendering.Request) -> ApiCall:
        assert request.resource is not None
        method = request.method.value.upper()
        if method == "GET":
            watching = request.params.get("watch", "").lower() == "true"
            verb = "watch" if watching else ("get" if request.name else "list")
        else:
            verb = _VERBS_BY_METHOD.get(method, method.lower())
        resource = request.resource.plural or ""
        if request.subresource:
            resource = f"{resource}/{request.subresource}"
        call = ApiCall(
            user_agent=request.headers.get("User-Agent", ""),
            verb=verb,
            group=request.resource.group or "",
            resource=resource,
            params=dict(request.params),
            content_type=request.headers.get("Content-Type", "").split(";")[0],
        )
        self.calls.append(call)
        return call

    def _key(self, request: rendering.Request) -> tuple[kmock.resource, str | None, str | None]:
        assert request.resource is not None
        if request.action == kmock.action.CREATE:
            metadata = (request.data or {}).get("metadata", {})
            return (
                request.resource,
                request.namespace or metadata.get("namespace"),
                metadata["name"],
            )
        return request.resource, request.namespace, request.name

    def _live(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    async def _write(self, key: tuple[Any, ...], store: Callable[[], Awaitable[T]]) -> T:
        """Run ``store`` (which changes the object at ``key``), then give the change its
        resourceVersion and its watch event, as the API server does for every write."""
        async with self._write_lock:
            before = self._live(key)
            result = await store()
            after = self._live(key)
            if before != after:
                self._resource_version += 1
                version = str(self._resource_version)
                if after is not None:
                    after.setdefault("metadata", {})["resourceVersion"] = version
                    # Assigning a key edits kmock's latest version in place (no new version).
                    self.objects[key]["metadata"] = copy.deepcopy(after["metadata"])
                    kind, obj = ("ADDED" if before is None else "MODIFIED"), after
                else:
                    assert before is not None
                    before.setdefault("metadata", {})["resourceVersion"] = version
                    kind, obj = "DELETED", before
                resource, namespace, _ = key
                self._history.append(_Event(self._resource_version, resource, namespace, kind, obj))
        async with self._changed:
            self._changed.notify_all()
        return result

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        async with self._write_lock:
            payload = await super()._serve_list(request)
            assert isinstance(payload, dict)
            payload["metadata"] = {"resourceVersion": str(self._resource_version)}
            return payload

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers now, as kmock's watch does: the client waits for them
        assert request.resource is not None
        plural = request.resource.plural or ""
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        stalled = self.stall_watches
        since = request.params.get("resourceVersion", "")
        watch = _OpenWatch(request)
        self._open_watches.add(watch)
        try:
            async with self._changed:
                if self._holding:
                    self.held[plural] += 1
                    self._changed.notify_all()
                    await self._changed.wait_for(lambda: not self._holding or watch.dropped)
                    self.held[plural] -= 1
            if watch.dropped:
                return
            async with self._write_lock:
                if since in ("", "0"):  # "from now": every live object as ADDED first
                    cursor = self._resource_version
                    initial = [
                        {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                        for (resource, namespace, _), obj in self.objects.items()
                        if resource == request.resource
                        and not obj.deleted
                        and request.namespace in (None, namespace)
                    ]
                elif int(since) < self._compacted_to or self.expire_watches:
                    self.gone_answers[plural] += 1
                    initial = [_gone_event(since)]
                    cursor = None
                else:
                    cursor, initial = int(since), []
            for event in initial:
                yield event
            if cursor is None:
                return
            watch.following = True
            self.following[plural] += 1
            if stalled:  # sends nothing and never ends: only a drop or the client ends it
                async with self._changed:
                    await self._changed.wait_for(lambda: watch.dropped)
                return
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            while True:
                async with self._changed:
                    left = (
                        None if deadline is None else deadline - asyncio.get_running_loop().time()
                    )
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(
                                lambda after=cursor: watch.dropped or self._resource_version > after
                            ),
                            left,
                        )
                    except TimeoutError:  # timeoutSeconds: the server ends the watch cleanly
                        return
                if watch.dropped:
                    return
                events = [
                    e
                    for e in self._history
                    if e.resource_version > cursor
                    and e.resource == request.resource
                    and request.namespace in (None, e.namespace)
                ]
                cursor = self._resource_version
                for event in events:
                    yield {"type": event.type, "object": copy.deepcopy(event.object)}
        finally:
            self._open_watches.discard(watch)
            if watch.following:
                self.following[plural] -= 1

    async def _handle_scale(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """``statefulsets/{name}/scale``: an autoscaling/v1 Scale view of spec.replicas."""
        key = (request.resource, request.namespace, request.name)
        if self._live(key) is None:
            return await self._render_error(kmock.KubernetesObjectNotFoundError())
        method = request.method.value.upper()
        if method in ("PUT", "PATCH"):
            replicas = ((request.data or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return await self._render_error(
                    kmock.KubernetesError(422, "Invalid", "spec.replicas: an integer >= 0")
                )

            async def store() -> None:
                self.objects[key].patch({"spec": {"replicas": replicas}})

            # The ordinary write path: resourceVersion and a MODIFIED event for watchers.
            await self._write(key, store)
        elif method != "GET":
            return await self._render_error(kmock.KubernetesError(405, "MethodNotAllowed"))
        statefulset = self._live(key)
        assert statefulset is not None
        return aiohttp.web.json_response(_scale_of(statefulset))

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        assert isinstance(payload, dict)
        for entry in payload.get("resources", []):
            if entry["name"].endswith("/scale"):
                entry.update(group="autoscaling", version="v1", kind="Scale")
        return payload

    # --- test controls (call in the server's loop: ApiServer does) -------------------------

    async def compact(self) -> None:
        """Forget the history so far: a watch from an older resourceVersion gets 410 Gone."""
        async with self._write_lock:
            self._compacted_to = self._resource_version
            self._history.clear()

    async def drop_watches(self) -> int:
        """Abort every open watch connection; returns how many were open."""
        dropped = 0
        async with self._changed:
            for watch in list(self._open_watches):
                if watch.dropped:
                    continue
                watch.dropped = True
                dropped += 1
                raw = watch.request._raw_request  # kmock keeps the aiohttp request here
                if raw is not None and raw.transport is not None:
                    raw.transport.abort()
            self._changed.notify_all()
        return dropped

    async def hold_watches(self) -> None:
        async with self._changed:
            self._holding = True

    async def release_watches(self) -> None:
        async with self._changed:
            self._holding = False
            self._changed.notify_all()

    async def fail_watches(self, plural: str, times: int) -> None:
        self._failing_watches[plural] += times


def _gone_event(since: str) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {since}",
            "reason": "Expired",
            "code": 410,
        },
    }


def _scale_of(statefulset: dict[str, Any]) -> dict[str, Any]:
    metadata = statefulset.get("metadata", {})
    labels = ((statefulset.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "resourceVersion": metadata.get("resourceVersion"),
        },
        "spec": {"replicas": (statefulset.get("spec") or {}).get("replicas", 1)},
        "status": {
            "replicas": (statefulset.get("status") or {}).get("replicas", 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        },
    }


@dataclass
class ApiServer:
    """An :class:`EmulatedKubeAPI` on 127.0.0.1, served by an event loop in its own thread.

    The tests run in the main thread and reach it only over HTTP, except for the fault
    controls, which run in the server's loop through :meth:`call`.
    """

    api: EmulatedKubeAPI | None = None
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    def __enter__(self) -> ApiServer:
        self._thread = threading.Thread(target=self._serve, name="kube-api", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the emulated API server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self.call(lambda api: api.drop_watches())
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with EmulatedKubeAPI() as api, kmock.Server(api) as server:
                self.api, self.url = api, str(server.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by __enter__
            self._error = exc
            self._ready.set()

    def call(self, fn: Callable[[EmulatedKubeAPI], Awaitable[T]], timeout: float = 30) -> T:
        """Run ``fn(api)`` in the server's loop and return its result."""
        assert self._loop is not None and self.api is not None
        api = self.api

        async def run() -> T:
            return await fn(api)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def configuration(self) -> client.Configuration:
        """Client settings for this server (plain HTTP, no credentials)."""
        configuration = client.Configuration()
        configuration.host = self.url
        return configuration
