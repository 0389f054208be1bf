"""Bench peers for torch's CUDA tensor sharing of expandable-segment tensors: torch's own path and the
drop-in (:mod:`dmabuf_interop.integrations.torch_sharing`), measured the same way as ``torch-ipc``.

Both set ``expandable_segments:True`` (``torch.cuda.memory._set_allocator_settings``) before the
first allocation, so the tensor lies in torch's ``cuMemCreate`` pages. torch's own consumer then
fetches the producer's fds with ``pidfd_open`` + ``pidfd_getfd`` (same PID namespace here); the
drop-in's takes them from the producer's broker (``SCM_RIGHTS``), once per segment chunk.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MECHANISMS", "peers"]

MECHANISMS: dict[str, tuple[str, str | None, str]] = {
    "torch-ipc-expandable": (
        "peer", "torch",
        "torch.multiprocessing sharing of a tensor in an expandable segment (expandable_segments:True), as "
        "torch-ipc: ForkingPickler.dumps (reduce_tensor: the segment's pages exported as fds, an IPC event, the "
        "ref counter), loads in the consumer (pidfd_getfd of each fd, import and map)"),
    "torch-sharing": (
        "ours", "torch",
        "the drop-in (integrations.torch_sharing.install() in both): the same dumps/loads of a tensor in an "
        "expandable segment; dumps registers the storage with the producer's broker (pages found and cached by "
        "channel.segments, no export once cached), loads borrows it over the broker's socket (the chunk's fds "
        "the first time, SCM_RIGHTS; afterwards a JSON round trip) and maps it once per chunk"),
}


def peers(torch_ipc: type) -> dict[str, type]:
    """The two peers, built on the bench's ``TorchIpc`` peer (passed in: no import of ``.peers`` here)."""

    class TorchIpcExpandable(torch_ipc):  # type: ignore[misc, valid-type]
        ours = False

        def setup(self) -> dict[str, Any]:
            try:
                import torch
            except ImportError:
                return super().setup()  # reports "not installed"
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            if self.ours:
                from ...integrations import torch_sharing

                torch_sharing.install()
            return super().setup()

    class TorchSharing(TorchIpcExpandable):
        ours = True

    return {"torch-ipc-expandable": TorchIpcExpandable, "torch-sharing": TorchSharing}
