"""The interface every sharing mechanism implements: export, import, gate, and the test pattern."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import capabilities

if TYPE_CHECKING:
    from ..buffers import ExportedBuffer, ImportedBuffer
    from ..descriptor import ShareDescriptor

__all__ = ["Mechanism"]


class Mechanism:
    """One way to share memory through an fd.

    Attributes:
        name: the mechanism's name (:class:`~dmabuf_interop.kinds.MechanismName`).
        uses_cuda: whether the CUDA driver is needed.
        gate_attribute: the device attribute (``CU_DEVICE_ATTRIBUTE_`` dropped) that must be 1
            on the exporter's device; ``None``: no gate.
        pair_attributes: ``(producer, consumer)`` attributes for a cross-GPU pair, or ``None``.
        need_peer_access: whether the consumer GPU must have peer access to the producer's.
    """

    name = ""
    uses_cuda = True
    gate_attribute: str | None = None
    pair_attributes: tuple[str, str] | None = None
    need_peer_access = False

    def export(self, size: int, device: int) -> "ExportedBuffer":
        """Allocate ``size`` bytes (> 0) on ``device`` and export them.

        Raises:
            NotSupportedError: the capability is absent here.
            CudaError: a driver call of the allocation or export failed.
            SyscallError: a syscall of the allocation or export failed (memfd).
            InvalidArgumentError: a bad size or ordinal.
        """
        raise NotImplementedError

    def import_(self, fd: int, descriptor: "ShareDescriptor", device: int) -> "ImportedBuffer":
        """Map what an exporter described; ``fd`` is not consumed.

        Raises:
            NotSupportedError: this process or device cannot import it.
            CudaError: a driver call of the import failed.
            SyscallError: a syscall of the import failed (memfd).
            InvalidArgumentError: the fd is not of this mechanism's kind.
        """
        raise NotImplementedError

    def write_pattern(self, exported: "ExportedBuffer") -> None:
        """Write ``0x1000 + i`` (int32) over the whole buffer and finish before returning (safe to send the fd).

        Raises:
            CudaError: compiling (NVRTC), launching or synchronising failed (CUDA mechanisms).
        """
        from ..kernels import write_pattern

        write_pattern(exported.ptr, exported.size, exported.device)  # synchronises its stream

    def count_mismatches(self, imported: "ImportedBuffer") -> int:
        """How many of the ``size // 4`` int32 elements of the import differ from ``0x1000 + i`` (0: intact).

        Raises:
            CudaError: compiling (NVRTC), launching or the copy back failed (CUDA mechanisms).
        """
        from ..kernels import count_mismatches

        return count_mismatches(imported.ptr, imported.size, imported.device)

    def gate(self, device: int) -> str | None:
        """The capability attribute ``device`` lacks for this mechanism, or ``None`` when it may run.

        Reads :attr:`gate_attribute` with ``cuDeviceGetAttribute``; the name is returned
        without its ``CU_DEVICE_ATTRIBUTE_`` prefix (e.g. ``"HOST_ALLOC_DMA_BUF_SUPPORTED"``).
        """
        if self.gate_attribute is None:
            return None
        if capabilities.attribute(device, self.gate_attribute) != 1:
            return self.gate_attribute
        return None

    def pair(self) -> tuple[int, int] | None:
        """The cross-GPU ``(producer, consumer)`` ordinals, or ``None`` where no pair qualifies.

        The first device in ordinal order with the producer attribute, then the first
        other one with the consumer attribute (and peer access where
        :attr:`need_peer_access`): deterministic, so a forked child and its parent agree.
        """
        if self.pair_attributes is None:
            return None
        producer, consumer = self.pair_attributes
        return capabilities.find_cross_gpu_pair(producer, consumer, need_peer_access=self.need_peer_access)
