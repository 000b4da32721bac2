"""ShmRing and RegionReader.read_output: a worker's output ring (protocol §5.5),
on real /dev/shm regions and real byte-range locks."""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from carpool.common.shm import HEADER_BYTES, SHM_DIR, RegionReader, ShmError, ShmRing
from carpool.common.shm import available as shm_available

pytestmark = pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    r = ShmRing(4096 + HEADER_BYTES)  # rounded up to pages: capacity 8128 on 4 KiB pages
    yield r
    r.close()


@pytest.fixture
def reader() -> Iterator[RegionReader]:
    r = RegionReader()
    yield r
    r.close()


def data(n: int, seed: int) -> memoryview:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).data


def write(ring: ShmRing, payload: memoryview) -> tuple[str, int, str, int]:
    (spot,) = ring.place([len(payload)])  # type: ignore[misc]
    assert spot is not None
    assert ring.write(spot[0], payload)
    return ring.name, spot[0], ring.key, spot[1]


def read(reader: RegionReader, ref: tuple[str, int, str, int], n: int) -> bytes:
    dest = bytearray(n)
    reader.read_output(ref, memoryview(dest))
    return bytes(dest)


def lock(fd: int, kind: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, 0, start, length, 0))


def test_outputs_round_trip_in_order(ring: ShmRing, reader: RegionReader) -> None:
    a, b = data(1000, 1), data(2000, 2)
    ref_a, ref_b = write(ring, a), write(ring, b)
    assert ref_a[1] == HEADER_BYTES
    assert ref_a[3] == 0
    assert ref_b[3] == 1024  # aligned to 64
    assert read(reader, ref_b, 2000) == b.tobytes()
    assert read(reader, ref_a, 1000) == a.tobytes()


def test_a_written_over_output_is_refused_not_misread(ring: ShmRing, reader: RegionReader) -> None:
    first = write(ring, data(3000, 1))
    for seed in range(2, 6):  # the ring comes round over `first`
        last = write(ring, data(3000, seed))
    with pytest.raises(ShmError, match="written over"):
        read(reader, first, 3000)
    assert read(reader, last, 3000) == data(3000, 5).tobytes()


def test_an_output_never_wraps_across_the_end(ring: ShmRing) -> None:
    capacity = ring.capacity
    write(ring, data(capacity - 100, 1))
    _, offset, _, seq = write(ring, data(200, 2))
    assert offset == HEADER_BYTES  # started over at the beginning
    assert seq == capacity  # the skipped tail counts in the stream
    assert ring.place([capacity + 1]) == [None]  # larger than the ring


def test_the_writer_never_waits_for_a_reader(ring: ShmRing, reader: RegionReader) -> None:
    """A reader's lock on a range makes the writer skip that range (the output then goes
    in its frame); a lock on the header makes it skip the ring for now."""
    ref = write(ring, data(1000, 1))
    fd = os.open(ring.path, os.O_RDONLY)
    try:
        lock(fd, fcntl.F_RDLCK, ref[1], 1000)  # a client copying `ref`
        # Come round over `ref` (three batches): placing works, writing over the locked
        # bytes does not.
        spots = [ring.place([3000]) for _ in range(3)]
        written = [ring.write(s[0][0], data(3000, 9)) for s in spots]  # type: ignore[index]
        assert written == [True, True, False]  # the third lands on `ref`
        lock(fd, fcntl.F_UNLCK, 0, 0)
        lock(fd, fcntl.F_RDLCK, 0, HEADER_BYTES)  # a client reading the header
        assert ring.place([10]) is None
        lock(fd, fcntl.F_UNLCK, 0, 0)
        assert ring.place([10]) is not None
    finally:
        os.close(fd)
    with pytest.raises(ShmError, match="written over"):  # and `ref` is known to be gone
        read(reader, ref, 1000)


def test_references_that_do_not_fit_the_ring_are_refused(
    ring: ShmRing, reader: RegionReader
) -> None:
    name, offset, key, seq = write(ring, data(100, 1))
    with pytest.raises(ShmError, match="offset and seq"):
        read(reader, (name, offset + 64, key, seq), 100)
    with pytest.raises(ShmError, match="written over"):  # beyond what was written
        read(reader, (name, offset, key, seq), 5000)
    with pytest.raises(ShmError, match="key"):
        read(reader, (name, offset, "0" * 32, seq), 100)


def test_a_ring_is_not_an_input_region_even_past_the_broker(
    ring: ShmRing, reader: RegionReader
) -> None:
    """The worker's own guard, for a BATCH from a broker that let such a reference by."""
    from carpool.common.protocol import parse_batch_refs

    ref = {"region": ring.name, "offset": 64, "key": ring.key}
    (parsed,) = parse_batch_refs([ref], 1)
    assert parsed is not None
    with pytest.raises(ShmError, match="is a worker's output ring"):
        reader.check(parsed, 16)
    with pytest.raises(ShmError, match="is a worker's output ring"):
        reader.read_into(parsed, memoryview(bytearray(16)))


def test_a_client_region_is_not_a_ring(reader: RegionReader) -> None:
    from carpool.common.shm import ShmArena

    arena = ShmArena(4096)
    try:
        off = arena.put(data(100, 1))
        assert off is not None
        with pytest.raises(ShmError, match="not a ring"):
            read(reader, (arena.name, off, arena.key, off - HEADER_BYTES), 100)
    finally:
        arena.close()


def test_close_removes_the_ring() -> None:
    r = ShmRing(8192)
    assert os.path.exists(r.path)
    assert r.name.startswith("carpool-out-")
    r.close()
    r.close()
    assert not os.path.exists(r.path)


def test_regions_may_belong_to_a_group_of_this_process() -> None:
    import grp

    from carpool.common.shm import ShmArena

    group = grp.getgrgid(os.getgid()).gr_name
    for region in (ShmRing(8192, mode=0o640, group=group), ShmArena(8192, group=group)):
        try:
            assert os.stat(region.path).st_gid == os.getgid()
        finally:
            region.close()
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(KeyError):
        ShmRing(8192, group="no-such-group-carpool")
    assert set(os.listdir(SHM_DIR)) == before  # nothing left behind


def test_one_batch_never_comes_round_over_its_own_outputs(ring: ShmRing) -> None:
    """Outputs placed since the batch's first one stay intact until its replies are
    sent: what would come round over them is refused (it goes in its frame)."""
    first = ring.place([3000])
    assert first is not None
    (spot,) = first
    assert spot is not None
    since = spot[1]
    assert ring.place([3000, 3000], since) == [(HEADER_BYTES + 3008, 3008), None]
    assert ring.place([3000], since) == [None]  # still this batch: still refused
    assert ring.place([3000]) is not None  # a new batch may come round


def _can_mount_a_private_tmpfs() -> bool:
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_a_private_tmpfs(), reason="needs root and unshare -m")
def test_a_full_dev_shm_is_an_error_up_front_not_a_sigbus() -> None:
    """A 4 MiB ring on a 1 MiB /dev/shm (a small container's): refused when it is made
    (the worker then sends outputs in frames), never a SIGBUS on a later write."""
    import subprocess
    import sys

    code = (
        "from carpool.common.shm import ShmArena, ShmRing\n"
        "for make in (ShmRing, ShmArena):\n"
        "    try:\n"
        "        make(4 << 20)\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise SystemExit(3)\n"
    )
    cmd = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "{sys.executable}" -c "$0"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd, code], timeout=60)
    assert proc.returncode == 0


def test_a_reader_lets_go_of_a_removed_ring_when_it_opens_another() -> None:
    """A worker restarts with a new ring: the client's reader closes the old ring's
    descriptor (which would keep its memory) when it opens the new one."""
    old, new = ShmRing(1 << 16), ShmRing(1 << 16)
    reader = RegionReader()
    try:
        for r in (old, new):
            ref = write(r, data(4096, 1))
            read(reader, ref, 4096)
            if r is old:
                old.close()
        assert list(reader._fds) == [new.name]
    finally:
        reader.close()
        old.close()
        new.close()
