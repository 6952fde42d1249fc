"""What the NVSHMEM transport computes without NVSHMEM: sizes, heap needs, the heap error, settings;
and that the GPU transport modules import on a machine without Triton or nvshmem4py."""

import subprocess
import sys

import pytest

from odc_plugin.comm.nvshmem_staging import (
    DEFAULT_HEAP_BYTES,
    HEAP_RESERVE,
    StagingConfig,
    heap_bytes_available,
    heap_bytes_needed,
    heap_too_small_message,
    parse_size,
    staging_bytes,
)


@pytest.mark.parametrize(
    "text,value",
    [
        ("1073741824", 1 << 30),
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("2G", 2 << 30),
        ("64k", 64 << 10),
        ("1.5G", 3 << 29),
        (" 1t ", 1 << 40),
        ("0.5k", 512),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "1GB", "-1G", "one"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="cannot read"):
        parse_size(text)


def test_heap_available_follows_the_environment():
    assert heap_bytes_available({}) == DEFAULT_HEAP_BYTES
    assert heap_bytes_available({"NVSHMEM_SYMMETRIC_SIZE": "4G"}) == 4 << 30


def test_staging_config():
    assert StagingConfig.from_env({}) == StagingConfig()
    cfg = StagingConfig.from_env({"ODC_NVSHMEM_SLOT_BYTES": "1M", "ODC_NVSHMEM_SLOTS": "3"})
    assert (cfg.slot_bytes, cfg.slots, cfg.payload_bytes) == (1 << 20, 3, (1 << 20) - 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        StagingConfig(slot_bytes=1000)
    with pytest.raises(ValueError, match="multiple of 64"):
        StagingConfig(slot_bytes=64)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        StagingConfig(slots=0)


def test_heap_needed():
    cfg = StagingConfig(slot_bytes=1 << 20, slots=2)
    assert staging_bytes(8, cfg) == (8 * 2 + 2) << 20
    # regions rounded up to 512 bytes; control words: 8 ranks * (2 slots + 4) * 8 bytes = 384 -> 512
    need = heap_bytes_needed([1000, 1 << 30, 0], 8, cfg)
    assert need == HEAP_RESERVE + (18 << 20) + 512 + 1024 + (1 << 30) + 512
    assert heap_bytes_needed([], 64, StagingConfig()) > 64 * 2 * (8 << 20)  # staging grows with the ranks


def test_heap_message_names_the_size_needed():
    msg = heap_too_small_message(int(2.5 * (1 << 30)), 1 << 30, "region 'odc.grads'")
    assert msg.startswith(
        "NVSHMEM symmetric heap too small for region 'odc.grads': ODC needs at least 2684354560 bytes"
    )
    assert "NVSHMEM_SYMMETRIC_SIZE gives 1073741824 bytes (1.00 GiB)" in msg
    assert "Set NVSHMEM_SYMMETRIC_SIZE=3G or more" in msg


def test_gpu_transports_import_without_optional_deps():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['nvshmem'] = None\n"
        "import odc_plugin.comm as c, odc_plugin.comm.cuda_ipc, odc_plugin.comm.nvshmem, odc_plugin.comm.select\n"
        "try:\n    import odc_plugin.comm.kernels\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "the ODC GPU transports need Triton" in out
