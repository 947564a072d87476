"""The TPU runtime's pinned host buffer: sized where the host pins memory slowly, never over a
user's own size, left to libtpu where transparent hugepages are always on."""

from __future__ import annotations

import pytest

from haiku_state import tpu_host

ALWAYS, MADVISE = "[always] madvise never\n", "always [madvise] never\n"


@pytest.fixture
def hugepages(tmp_path, monkeypatch):
    """Writes the kernel's transparent-hugepages setting the module reads."""
    setting = tmp_path / "enabled"
    monkeypatch.setattr(tpu_host, "HUGEPAGES_SETTING", str(setting))
    return setting.write_text


@pytest.mark.parametrize("setting", [MADVISE, "always madvise [never]\n", None])
def test_a_host_without_hugepages_always_gets_the_smaller_buffer(hugepages, setting):
    if setting is not None:  # None: no such file (not Linux, or a kernel without THP).
        hugepages(setting)
    environ = {}
    assert tpu_host.size_premapped_buffer(environ) == 512 << 20
    assert environ == {"TPU_PREMAPPED_BUFFER_SIZE": str(512 << 20)}


def test_a_host_with_hugepages_always_keeps_libtpus_default(hugepages):
    hugepages(ALWAYS)
    environ = {}
    assert tpu_host.size_premapped_buffer(environ) is None
    assert environ == {}


def test_the_users_own_size_is_kept(hugepages):
    hugepages(MADVISE)
    environ = {"TPU_PREMAPPED_BUFFER_SIZE": "4294967296"}
    assert tpu_host.size_premapped_buffer(environ) is None
    assert environ == {"TPU_PREMAPPED_BUFFER_SIZE": "4294967296"}
