"""Publishing from a trainer of one process, as the weights and generator tests and the benches
that drive a generator directly do (the trainer service gathers several ranks' parts instead:
``podrl.trainer.servicer``)."""

from __future__ import annotations

from podrl.v1 import weights_pb2
from podrl.weights import ManifestAssembler, Publisher


def publish_single_process(
    publisher: Publisher,
    assembler: ManifestAssembler,
    version: int,
    *,
    force_full: bool = False,
    ack_timeout: float = 0.0,
) -> weights_pb2.WeightManifest:
    """Start ``version`` on the one rank and assemble its manifest with ``assembler``."""
    part = publisher.start(version, ack_timeout=ack_timeout)
    return assembler.assemble(version, [part], force_full=force_full)
