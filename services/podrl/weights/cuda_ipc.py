"""CUDA IPC handles for GPU weights, through torch's own storage-sharing machinery.

``UntypedStorage._share_cuda_()`` exports the storage's base allocation (it also handles
expandable segments and torch's inter-process reference counting);
``UntypedStorage._new_shared_cuda()`` opens it in another process. Devices are named by UUID
because container device indices differ. Opening needs a shared PID namespace (the pod sets
``shareProcessNamespace: true``) and, with expandable segments, ``CAP_SYS_PTRACE``.
"""

from __future__ import annotations

import torch

from podrl.v1 import weights_pb2


def device_uuid(device: torch.device | int) -> str:
    """UUID of a CUDA device as torch reports it (stable across processes and containers)."""
    index = device if isinstance(device, int) else (device.index or 0)
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_for_uuid(uuid: str) -> int | None:
    """Local index of the CUDA device with ``uuid``, or None when this process cannot see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    return None


def export_tensor(tensor: torch.Tensor) -> weights_pb2.CudaIpcHandle:
    """The IPC handle of a CUDA tensor's storage plus where the tensor starts inside it."""
    storage = tensor.untyped_storage()
    (
        _device,
        handle,
        storage_nbytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return weights_pb2.CudaIpcHandle(
        device_uuid=device_uuid(tensor.device),
        handle=handle,
        offset=storage_offset,
        nbytes=storage_nbytes,
        event_handle=event_handle or b"",
        ref_counter_handle=ref_counter_handle or b"",
        ref_counter_offset=ref_counter_offset,
        event_sync_required=bool(event_sync_required),
        tensor_offset=tensor.storage_offset() * tensor.element_size(),
    )


# The device each handle was first opened on in this process. torch caches an opened handle
# by its bytes alone (CUDA maps an allocation once per process), so a second open returns the
# first mapping whatever device it asks for; reopening on that same device keeps the storage's
# device label true.
_OPENED_ON: dict[bytes, int] = {}


def open_storage(
    handle: weights_pb2.CudaIpcHandle, *, on_device: int | None = None
) -> tuple[torch.UntypedStorage, int]:
    """Open an exported storage in this process: (storage, local device index it lives on
    for torch).

    By default the memory is mapped on the device that owns it. ``on_device`` maps it on
    another GPU instead, through peer access (``cudaIpcMemLazyEnablePeerAccess``): kernels and
    copies on that GPU then read the owner's memory over NVLink as if it were local, so a
    GPU0 -> GPU1 copy is an ordinary GPU1 copy (one stream, graph-capturable) rather than a
    cross-device copy with an event pair per tensor. Falls back to the owner device when
    peer access is impossible or the handle is already open here on another device.

    Raises LookupError when the device is not visible here, RuntimeError when CUDA refuses.
    """
    owner = device_index_for_uuid(handle.device_uuid)
    if owner is None:
        raise LookupError(f"CUDA device {handle.device_uuid} is not visible to this process")
    index = _OPENED_ON.get(handle.handle, owner if on_device is None else on_device)
    if index != owner and not torch.cuda.can_device_access_peer(index, owner):
        index = owner
    try:
        storage = _new_shared(handle, index)
    except RuntimeError:
        if index == owner:
            raise
        index = owner
        storage = _new_shared(handle, index)
    _OPENED_ON.setdefault(handle.handle, index)
    return storage, index


def _new_shared(handle: weights_pb2.CudaIpcHandle, index: int) -> torch.UntypedStorage:
    with torch.cuda.device(index):
        return torch.UntypedStorage._new_shared_cuda(
            index,
            handle.handle,
            handle.nbytes,
            handle.offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
