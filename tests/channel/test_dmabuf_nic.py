"""The dma-buf-to-NIC recipe of docs/remote.md: an ``export_device`` fd registered with ``ibv_reg_dmabuf_mr``."""

from __future__ import annotations

import pytest

from dmabuf_interop.cli.info_nixl import format_nixl, rdma_devices


def _first_rdma_device() -> str:
    devices = rdma_devices()
    if not devices:
        pytest.skip("no RDMA device in /sys/class/infiniband: GPU memory to a NIC cannot be tested here")
    return devices[0]["name"]


@pytest.mark.gpu
def test_export_device_fd_registers_with_a_nic() -> None:
    name = _first_rdma_device()
    pyverbs = pytest.importorskip("pyverbs.mr", reason="pyverbs (rdma-core's Python binding) is not installed")
    from pyverbs import enums
    from pyverbs.device import Context
    from pyverbs.pd import PD

    from dmabuf_interop import export_device

    size = 2 << 20
    with export_device(size, 0) as buf, Context(name=name) as ctx, PD(ctx) as pd:
        access = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_READ | enums.IBV_ACCESS_REMOTE_WRITE
        with pyverbs.DmaBufMR(pd, size, access, fd=buf.fd, offset=buf.offset) as mr:
            assert mr.lkey and mr.rkey and mr.length == size


def test_rdma_devices_from_sysfs(tmp_path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert rdma_devices(str(tmp_path)) == [{"name": "mlx5_0", "ports": [
        {"port": "1", "state": "4: ACTIVE", "link_layer": "InfiniBand"}]}]
    assert rdma_devices(str(tmp_path / "absent")) == []


def test_format_without_nixl() -> None:
    text = format_nixl({"installed": False, "version": None, "error": None, "ucx_env": {},
                        "rdma": {"devices": [], "rdma_core": None, "gpu_dmabuf_to_nic": "no RDMA device"}})
    assert "dmabuf-interop[nixl]" in text and "RDMA devices: none" in text
