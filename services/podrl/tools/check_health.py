"""Check gRPC health of podrl services; exit 0 only if every target answers SERVING.

The Helm chart's ``helm test`` pod runs this (it needs only grpcio, so the controller image,
which has no torch, carries it). Usage::

    python -m podrl.tools.check_health [--timeout S] TARGET=SERVICE [TARGET=SERVICE ...]

TARGET is ``host:port``, or ``all:host:port`` to check every address ``host`` resolves to (a
headless Service name resolves to all its pods). SERVICE is the ``grpc.health.v1`` service
name, e.g. ``podrl.v1.Trainer``; an empty SERVICE asks for the server's overall health.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from podrl.cli.probes import grpc_health

ALL_ADDRESSES_PREFIX = "all:"


@dataclass(frozen=True)
class HealthTarget:
    """One ``TARGET=SERVICE`` argument."""

    host: str
    port: int
    service: str
    all_addresses: bool

    @classmethod
    def parse(cls, text: str) -> HealthTarget:
        target, sep, service = text.partition("=")
        all_addresses = target.startswith(ALL_ADDRESSES_PREFIX)
        if all_addresses:
            target = target[len(ALL_ADDRESSES_PREFIX) :]
        host, colon, port_text = target.rpartition(":")
        if not sep or not colon or not host or not port_text.isdigit():
            raise ValueError(
                f"bad target {text!r}: write [all:]HOST:PORT=SERVICE, "
                "e.g. podrl-controller:50050=podrl.v1.Controller"
            )
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise ValueError(f"bad target {text!r}: port {port} is not in 1..65535")
        return cls(host.strip("[]"), port, service, all_addresses)

    def addresses(self) -> list[str]:
        """``host:port`` strings to dial (several for ``all:``; [] if the name does not resolve)."""
        if not self.all_addresses:
            return [_join(self.host, self.port)]
        try:
            infos = socket.getaddrinfo(self.host, self.port, proto=socket.IPPROTO_TCP)
        except socket.gaierror:
            return []
        return sorted({_join(str(info[4][0]), self.port) for info in infos})


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check(targets: Sequence[HealthTarget], timeout: float) -> list[tuple[str, str, str]]:
    """(address, service, status) for every address of every target."""
    results: list[tuple[str, str, str]] = []
    for target in targets:
        addresses = target.addresses()
        if not addresses:
            results.append((f"{target.host}:{target.port}", target.service, "NO_ADDRESS"))
        for address in addresses:
            results.append((address, target.service, grpc_health(address, target.service, timeout)))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", metavar="[all:]HOST:PORT=SERVICE")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per health check")
    args = parser.parse_args(argv)
    try:
        targets = [HealthTarget.parse(text) for text in args.targets]
    except ValueError as exc:
        parser.error(str(exc))
    results = check(targets, args.timeout)
    for address, service, status in results:
        print(f"{status:<12} {address} {service or '<overall>'}")
    failed = [r for r in results if r[2] != "SERVING"]
    print(f"{len(results) - len(failed)}/{len(results)} SERVING")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
