"""podrl's vLLM general plugin (podrl.generator.vllm_plugin): vLLM's message-queue readers stop
spinning soon after a message. In a fresh interpreter each, since it patches vLLM's class."""

from __future__ import annotations

import pytest

from podrl.generator.vllm_plugin import IDLE_SPIN_ENV
from tests.generator.fresh_interpreter import run_with

#: Builds a reader and a writer SpinCondition after vLLM's own plugin loading, prints their spin.
PROBE = """
import zmq
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
context = zmq.Context()
address = get_open_zmq_ipc_path()
writer = SpinCondition(is_reader=False, context=context, notify_address=address)
reader = SpinCondition(is_reader=True, context=context, notify_address=address)
print(reader.busy_loop_s, writer.busy_loop_s)
"""


def _spin_times(value: str | None) -> tuple[float, float]:
    reader, writer = run_with(IDLE_SPIN_ENV, value, PROBE).split()[-2:]
    return float(reader), float(writer)


def test_vllm_loads_the_plugin_and_readers_take_the_configured_spin() -> None:
    assert _spin_times("0.05") == (0.05, 0)


@pytest.mark.parametrize("value", [None, "soon", "-1", "nan"])
def test_without_a_usable_value_vllms_spin_is_kept(value: str | None) -> None:
    assert _spin_times(value) == (1, 0)
