"""An API server for `helm template --dry-run=server`: kmock's Kubernetes emulator over real HTTP
on loopback, so the chart's ``lookup`` calls are answered as a cluster would answer them.

kmock serves discovery, get, list and create. Three things helm needs are added here: a
server version the chart accepts (kmock reports 1.26), the core group's ``groupVersion`` as
``v1`` (kmock writes ``/v1``, which helm's REST mapper does not match), and the chart's kinds in
discovery (helm maps every rendered object to a resource before it renders the release).
OpenAPI is not served: run helm with ``--disable-openapi-validation``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import kmock


@attrs.define(kw_only=True)
class _Emulator(kmock.KubernetesEmulator):
    kube_version: tuple[str, str] = ("1", "35")

    async def _serve_server_version(self, request: Any) -> dict[str, str]:
        major, minor = self.kube_version
        return {"major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0"}

    async def _serve_version(self, request: Any) -> dict[str, Any]:
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].removeprefix("/")
        return payload


def _plural(kind: str) -> str:
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


@contextmanager
def fake_cluster(kinds: list[tuple[str, str]], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An emulated API server that knows the (apiVersion, kind) pairs in ``kinds``; yields its
    URL and a kubeconfig file pointing at it (namespaced resources, no credentials)."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        state["loop"] = asyncio.get_running_loop()
        state["stop"] = asyncio.Event()
        async with _Emulator() as api, kmock.Server(api) as server:
            for api_version, kind in kinds:
                api.resources[f"{api_version}/{_plural(kind)}"] = kmock.ResourceInfo(
                    kind=kind,
                    singular=kind.lower(),
                    namespaced=True,
                    verbs={"create", "get", "list", "patch", "delete"},
                )
            state["url"] = str(server.url).rstrip("/")
            ready.set()
            await state["stop"].wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as err:  # reported below
            state["error"] = err
            ready.set()

    thread = threading.Thread(target=run, name="fake-cluster", daemon=True)
    thread.start()
    if not ready.wait(30) or "error" in state:
        raise RuntimeError(f"the emulated API server did not start: {state.get('error')!r}")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{state['url']}'}}}}]\n"
        "users: [{name: fake, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
    )
    try:
        yield state["url"], kubeconfig
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)


def create(url: str, obj: dict[str, Any]) -> None:
    """Store ``obj`` in the emulated cluster (namespaced core/v1 or group objects)."""
    group_version = obj["apiVersion"]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    namespace = obj["metadata"]["namespace"]
    path = f"{prefix}/namespaces/{namespace}/{_plural(obj['kind'])}"
    httpx.post(url + path, json=obj, timeout=10).raise_for_status()
