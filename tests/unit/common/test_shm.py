"""shm.py: the client's arena (a real /dev/shm region) and the worker's reader."""

from __future__ import annotations

import itertools
import os
import random
import stat
from collections.abc import Iterator

import numpy as np
import pytest

from carpool.common.errors import ProtocolError
from carpool.common.shm import ALIGN, SHM_DIR, RegionReader, ShmArena, ShmError, parse_ref

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def data(n: int, seed: int = 0) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    a = ShmArena(64 * 1024)
    yield a
    a.close()


def test_region_is_a_private_file_named_for_carpool(arena: ShmArena) -> None:
    assert arena.name.startswith("carpool-")
    info = os.stat(arena.path)
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == arena.size == 64 * 1024


def test_mode_is_not_narrowed_by_the_umask() -> None:
    old = os.umask(0o077)
    try:
        a = ShmArena(4096, mode=0o640)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o640
    finally:
        a.close()


def test_put_writes_the_bytes_where_the_offset_says(arena: ShmArena) -> None:
    a, b = data(1000, 1), data(3000, 2)
    off_a, off_b = arena.put(a), arena.put(b)
    assert off_a is not None
    assert off_b is not None
    assert off_a % ALIGN == 0
    assert off_b % ALIGN == 0
    assert off_b >= off_a + 1000
    with open(arena.path, "rb") as f:
        f.seek(off_a)
        assert f.read(1000) == a.tobytes()
        f.seek(off_b)
        assert f.read(3000) == b.tobytes()


def test_full_arena_says_none_and_freeing_makes_room(arena: ShmArena) -> None:
    offsets = [arena.put(data(16 * 1024)) for _ in range(4)]
    assert None not in offsets
    assert arena.put(data(1)) is None
    arena.free(offsets[1])
    assert arena.put(data(20 * 1024)) is None  # 16 KiB free: not enough
    assert arena.put(data(16 * 1024)) == offsets[1]


def test_free_merges_neighbours_back_into_one_block(arena: ShmArena) -> None:
    offsets = [arena.put(data(8 * 1024)) for _ in range(8)]
    for i in (1, 3, 2, 0, 7, 5, 6, 4):  # any order
        arena.free(offsets[i])  # type: ignore[arg-type]
    assert arena.used_bytes == 0
    assert arena.put(data(64 * 1024)) == 0  # the whole region in one piece


def test_random_puts_and_frees_never_overlap(arena: ShmArena) -> None:
    rng = random.Random(3)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            arena.free(off)
            del live[off]
        else:
            n = rng.randint(1, 9000)
            off = arena.put(data(n))
            if off is not None:
                live[off] = n
        spans = sorted((o, o + n) for o, n in live.items())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert all(end <= arena.size for _, end in spans)
    for off in list(live):
        arena.free(off)
    assert arena.put(data(arena.size)) == 0


def test_free_of_an_unknown_offset_is_ignored(arena: ShmArena) -> None:
    arena.free(12345)
    assert arena.used_bytes == 0


def test_close_unlinks_the_region() -> None:
    a = ShmArena(4096)
    assert os.path.exists(a.path)
    a.close()
    a.close()  # twice is fine
    assert not os.path.exists(a.path)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        ShmArena(0)


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    "obj",
    [
        None,
        [],
        {"region": "carpool-x"},
        {"region": "other-x", "offset": 0},
        {"region": "carpool-../etc", "offset": 0},
        {"region": "carpool-a/b", "offset": 0},
        {"region": "carpool-", "offset": 0},
        {"region": b"carpool-x", "offset": 0},
        {"region": "carpool-x", "offset": -1},
        {"region": "carpool-x", "offset": True},
        {"region": "carpool-x", "offset": 1.0},
        {"region": "carpool-x", "offset": 2**62 + 1},
    ],
)
def test_bad_references_are_protocol_errors(obj: object) -> None:
    with pytest.raises(ProtocolError):
        parse_ref(obj, "tensor 'x'")


def test_a_good_reference() -> None:
    assert parse_ref({"region": "carpool-1-ab.c_d", "offset": 64}, "t") == ("carpool-1-ab.c_d", 64)


# --------------------------------------------------------------------------- reader


def test_reader_reads_what_the_arena_wrote(arena: ShmArena) -> None:
    payload = data(5000, 9)
    off = arena.put(payload)
    assert off is not None
    reader = RegionReader()
    dest = bytearray(5000)
    reader.read_into(arena.name, off, memoryview(dest))
    assert bytes(dest) == payload.tobytes()
    # Written again at the same place: the reader sees the new bytes (no stale copy).
    arena.free(off)
    assert arena.put(data(5000, 10)) == off
    reader.read_into(arena.name, off, memoryview(dest))
    assert bytes(dest) == data(5000, 10).tobytes()
    reader.close()


def test_reader_refuses_a_read_past_the_end(arena: ShmArena) -> None:
    reader = RegionReader()
    with pytest.raises(ShmError, match="ends before") as info:
        reader.read_into(arena.name, arena.size - 10, memoryview(bytearray(20)))
    assert not info.value.unreachable
    reader.close()


def test_a_missing_region_is_unreachable() -> None:
    reader = RegionReader()
    with pytest.raises(ShmError, match="cannot be opened") as info:
        reader.read_into("carpool-does-not-exist-0", 0, memoryview(bytearray(4)))
    assert info.value.unreachable


def test_reader_does_not_follow_symlinks_or_read_other_names(tmp_path: object) -> None:
    target = os.path.join(str(tmp_path), "secret")
    with open(target, "wb") as f:
        f.write(b"x" * 100)
    reader = RegionReader(directory=str(tmp_path))
    os.symlink(target, os.path.join(str(tmp_path), "carpool-link"))
    with pytest.raises(ShmError):
        reader.read_into("carpool-link", 0, memoryview(bytearray(4)))
    with pytest.raises(ShmError, match="not a carpool"):
        reader.read_into("secret", 0, memoryview(bytearray(4)))
    os.mkdir(os.path.join(str(tmp_path), "carpool-dir"))
    with pytest.raises(ShmError):
        reader.read_into("carpool-dir", 0, memoryview(bytearray(4)))


def test_reader_keeps_a_bounded_number_of_regions_open() -> None:
    arenas = [ShmArena(4096) for _ in range(5)]
    try:
        reader = RegionReader(max_open=2)
        for a in arenas:
            off = a.put(data(10))
            reader.read_into(a.name, off or 0, memoryview(bytearray(10)))
        assert len(reader._fds) == 2
        reader.close()
        assert not reader._fds
    finally:
        for a in arenas:
            a.close()
