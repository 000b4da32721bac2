"""carpool.common.shm: the client's arena (a real /dev/shm region) and the worker's reader."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from carpool.common.errors import ProtocolError
from carpool.common.shm import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    RegionReader,
    ShmArena,
    ShmError,
    ShmRing,
    parse_ref,
    sweep_orphans,
)
from carpool.common.shm import available as shm_available

KEY = "0123456789abcdef" * 2

pytestmark = pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")


def data(n: int, seed: int = 0) -> memoryview:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).data


def put_fitting(arena: ShmArena, view: memoryview) -> int:
    """Put bytes the arena has room for: their offset (None here fails the test)."""
    off = arena.put(view)
    assert off is not None
    return off


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
    offsets = [put_fitting(arena, data(16 * 1024)) for _ in range(3)]
    offsets.append(put_fitting(arena, data(16 * 1024 - HEADER_BYTES)))  # the rest after the header
    assert offsets[0] == HEADER_BYTES
    assert arena.put(data(1)) is None
    arena.free(offsets[1])
    assert arena.put(data(20 * 1024)) is None  # 16 KiB free: not enough
    assert arena.put(data(16 * 1024)) == offsets[1]


def test_the_region_starts_with_its_header_and_key(arena: ShmArena) -> None:
    with open(arena.path, "rb") as f:
        head = f.read(HEADER_BYTES)
    assert head.startswith(MAGIC)
    assert head[len(MAGIC) : len(MAGIC) + 16].hex() == arena.key
    assert ShmArena(4096).key != arena.key


def test_free_merges_neighbours_back_into_one_block(arena: ShmArena) -> None:
    sizes = [8 * 1024] * 7 + [8 * 1024 - HEADER_BYTES]  # the last: the rest after the header
    offsets = [put_fitting(arena, data(n)) for n in sizes]
    for i in (1, 3, 2, 0, 7, 5, 6, 4):  # any order
        arena.free(offsets[i])
    assert arena.used_bytes == 0
    whole = 64 * 1024 - HEADER_BYTES
    assert arena.put(data(whole)) == HEADER_BYTES  # the whole region in one piece


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
            placed = arena.put(data(n))
            if placed is not None:
                live[placed] = n
        spans = sorted((o, o + n) for o, n in live.items())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert all(start >= HEADER_BYTES and end <= arena.size for start, end in spans)
        assert all(start % ALIGN == 0 for start, _ in spans)
        free = arena._free
        assert free == sorted(free)
        for (s1, l1), (s2, _) in itertools.pairwise(free):
            assert s1 + l1 < s2  # merged: no two free blocks touch
        assert sum(n for _, n in free) + arena.used_bytes == arena.size - HEADER_BYTES
    for off in list(live):
        arena.free(off)
    assert arena.put(data(arena.size - HEADER_BYTES)) == HEADER_BYTES


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
    for size in (0, HEADER_BYTES):
        with pytest.raises(ValueError, match="size"):
            ShmArena(size)


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    "obj",
    [
        None,
        [],
        {"region": "carpool-x", "key": KEY},
        {"region": "other-x", "offset": 64, "key": KEY},
        {"region": "carpool-../etc", "offset": 64, "key": KEY},
        {"region": "carpool-a/b", "offset": 64, "key": KEY},
        {"region": "carpool-", "offset": 64, "key": KEY},
        {"region": b"carpool-x", "offset": 64, "key": KEY},
        {"region": "carpool-x", "offset": -1, "key": KEY},
        {"region": "carpool-x", "offset": 0, "key": KEY},  # the header
        {"region": "carpool-x", "offset": True, "key": KEY},
        {"region": "carpool-x", "offset": 64.0, "key": KEY},
        {"region": "carpool-x", "offset": 2**62 + 1, "key": KEY},
        {"region": "carpool-x", "offset": 64},
        {"region": "carpool-x", "offset": 64, "key": KEY.upper()},
        {"region": "carpool-x", "offset": 64, "key": KEY[:-1]},
        {"region": "carpool-x", "offset": 64, "key": bytes.fromhex(KEY)},
    ],
)
def test_bad_references_are_protocol_errors(obj: object) -> None:
    with pytest.raises(ProtocolError):
        parse_ref(obj, "tensor 'x'")


def test_a_good_reference() -> None:
    ref = {"region": "carpool-1-ab.c_d", "offset": 64, "key": KEY}
    assert parse_ref(ref, "t") == ("carpool-1-ab.c_d", 64, KEY)


# --------------------------------------------------------------------------- reader


def test_reader_reads_what_the_arena_wrote(arena: ShmArena) -> None:
    payload = data(5000, 9)
    off = arena.put(payload)
    assert off is not None
    reader = RegionReader()
    dest = bytearray(5000)
    reader.read_into((arena.name, off, arena.key), memoryview(dest))
    assert bytes(dest) == payload.tobytes()
    # Written again at the same place: the reader sees the new bytes (no stale copy).
    arena.free(off)
    assert arena.put(data(5000, 10)) == off
    reader.read_into((arena.name, off, arena.key), memoryview(dest))
    assert bytes(dest) == data(5000, 10).tobytes()
    reader.close()


def test_reader_refuses_a_read_past_the_end(arena: ShmArena) -> None:
    reader = RegionReader()
    with pytest.raises(ShmError, match="ends before") as info:
        reader.read_into((arena.name, arena.size - 10, arena.key), memoryview(bytearray(20)))
    assert not info.value.unreachable
    reader.close()


def test_a_missing_region_is_unreachable() -> None:
    reader = RegionReader()
    with pytest.raises(ShmError, match="cannot be opened") as info:
        reader.read_into(("carpool-does-not-exist-0", 64, KEY), memoryview(bytearray(4)))
    assert info.value.unreachable


def test_reader_does_not_follow_symlinks_or_read_other_names(tmp_path: object) -> None:
    target = os.path.join(str(tmp_path), "secret")
    with open(target, "wb") as f:
        f.write(MAGIC + bytes.fromhex(KEY) + b"x" * 100)
    reader = RegionReader(directory=str(tmp_path))
    os.symlink(target, os.path.join(str(tmp_path), "carpool-link"))
    with pytest.raises(ShmError):
        reader.read_into(("carpool-link", 64, KEY), memoryview(bytearray(4)))
    with pytest.raises(ShmError, match="not a carpool"):
        reader.read_into(("secret", 64, KEY), memoryview(bytearray(4)))
    os.mkdir(os.path.join(str(tmp_path), "carpool-dir"))
    with pytest.raises(ShmError):
        reader.read_into(("carpool-dir", 64, KEY), memoryview(bytearray(4)))
    # The same file under a carpool name (not a link) is readable: the tests above
    # failed for the link and the name, not for the content.
    os.link(target, os.path.join(str(tmp_path), "carpool-hard"))
    reader.read_into(("carpool-hard", 64, KEY), memoryview(bytearray(4)))


def test_a_reference_needs_the_regions_key(arena: ShmArena) -> None:
    """The name of a region is visible to anyone in /dev/shm; its key only to whoever
    can read it. A worker reads for a reference only with the right key."""
    off = arena.put(data(100))
    assert off is not None
    reader = RegionReader()
    with pytest.raises(ShmError, match="key") as info:
        reader.read_into((arena.name, off, KEY), memoryview(bytearray(100)))
    assert not info.value.unreachable
    reader.read_into((arena.name, off, arena.key), memoryview(bytearray(100)))  # cached fd
    with pytest.raises(ShmError, match="key"):
        reader.read_into((arena.name, off, KEY), memoryview(bytearray(100)))
    reader.close()


def test_a_file_without_the_header_is_not_a_region(tmp_path: object) -> None:
    for name, content in (("carpool-empty", b""), ("carpool-plain", b"\0" * 4096)):
        with open(os.path.join(str(tmp_path), name), "wb") as f:
            f.write(content)
        reader = RegionReader(directory=str(tmp_path))
        with pytest.raises(ShmError, match="not a carpool region"):
            reader.read_into((name, 64, "0" * 32), memoryview(bytearray(4)))


def test_reader_keeps_a_bounded_number_of_regions_open() -> None:
    arenas = [ShmArena(4096) for _ in range(5)]
    try:
        reader = RegionReader(max_open=2)
        for a in arenas:
            off = a.put(data(10))
            assert off is not None
            reader.read_into((a.name, off, a.key), memoryview(bytearray(10)))
        assert len(reader._fds) == 2
        reader.close()
        assert not reader._fds
    finally:
        for a in arenas:
            a.close()


def test_removed_regions_are_let_go() -> None:
    """An open descriptor keeps a removed region's memory: the reader drops it on its
    next use or at the next sweep."""
    a, b = ShmArena(4096), ShmArena(4096)
    reader = RegionReader()
    try:
        for arena in (a, b):
            off = arena.put(data(10))
            assert off is not None
            reader.read_into((arena.name, off, arena.key), memoryview(bytearray(10)))
        assert set(reader._fds) == {a.name, b.name}
        a.close()
        assert reader.sweep() == 1
        assert set(reader._fds) == {b.name}
        b.close()
        with pytest.raises(ShmError, match="cannot be opened") as info:
            reader.read_into((b.name, HEADER_BYTES, b.key), memoryview(bytearray(10)))
        assert info.value.unreachable
        assert not reader._fds
        assert reader.sweep() == 0
    finally:
        a.close()
        b.close()
        reader.close()


def test_a_forked_child_does_not_remove_its_parents_region() -> None:
    arena = ShmArena(4096)
    try:
        pid = os.fork()
        if pid == 0:  # the child drops its copy of the client's arena
            try:
                arena.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.exists(arena.path)
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


# --------------------------------------------------------------------------- hostile and dead peers


def test_a_region_truncated_under_its_owner_does_not_kill_it() -> None:
    """Writes go through pwrite, not a mapping: anyone who can write the file may
    truncate it, and the owner's next write still does not die of SIGBUS."""
    code = (
        "import os\n"
        "import numpy as np\n"
        "from carpool.common.shm import ShmArena, ShmRing\n"
        "ring, arena = ShmRing(1 << 20), ShmArena(1 << 20)\n"
        "for path in (ring.path, arena.path):\n"
        "    fd = os.open(path, os.O_RDWR)\n"
        "    os.ftruncate(fd, 0)\n"
        "    os.close(fd)\n"
        "(spot,) = ring.place([1 << 17])\n"
        "assert ring.write(spot[0], memoryview(np.ones(1 << 17, np.uint8)))\n"
        "assert arena.put(memoryview(np.ones(1 << 17, np.uint8))) is not None\n"
        "ring.close()\n"
        "arena.close()\n"
        "print('survived')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"rc={out.returncode} {out.stderr[-500:]}"
    assert out.stdout.strip() == "survived"


@pytest.mark.parametrize("mode", [0o660, 0o622, 0o666, 0o1600])
def test_regions_others_could_write_are_refused(mode: int) -> None:
    with pytest.raises(ValueError, match="never write"):
        ShmArena(1 << 16, mode=mode)
    with pytest.raises(ValueError, match="never write"):
        ShmRing(1 << 16, mode=mode)


def test_the_regions_of_a_process_that_died_are_removed_and_live_ones_kept() -> None:
    """A worker killed in a crash loop leaves no ring behind in /dev/shm (RAM, for
    good): owners hold a shared flock, and a region nobody holds is an orphan, removed."""
    made = (
        "import os, sys\n"
        "from carpool.common.shm import ShmRing\n"
        "ring = ShmRing(1 << 16)\n"
        "print(ring.path, flush=True)\n"
        "if sys.argv[1] == 'die':\n"
        "    os.kill(os.getpid(), 9)\n"
        "sys.stdin.read()\n"
    )
    dead = subprocess.run(
        [sys.executable, "-c", made, "die"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    live = subprocess.Popen(
        [sys.executable, "-c", made, "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mine = ShmArena(1 << 16)
    try:
        assert live.stdout is not None
        alive = live.stdout.readline().strip()
        assert os.path.exists(dead)
        removed = sweep_orphans(min_age_s=0.0)
        assert dead in removed
        assert not os.path.exists(dead)
        assert os.path.exists(alive)
        assert os.path.exists(mine.path)
        assert sweep_orphans(min_age_s=3600.0) == []  # a young orphan is left alone
    finally:
        mine.close()
        live.communicate("", timeout=30)
        for path in (dead, alive):
            with contextlib.suppress(FileNotFoundError, NameError):
                os.unlink(path)


def test_a_region_of_a_running_process_that_holds_no_lock_is_kept() -> None:
    """An older carpool whose regions hold no lock may run on the host: a region is an
    orphan only once the pid in its name is gone too."""
    live = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    paths = [
        f"/dev/shm/carpool-{live.pid}-0123abcd",
        f"/dev/shm/carpool-{dead.stdout.strip()}-0123abcd",
    ]
    try:
        for path in paths:
            with open(path, "wb") as f:
                f.write(MAGIC + bytes(64))
        removed = sweep_orphans(min_age_s=0.0)
        assert paths[0] not in removed
        assert os.path.exists(paths[0])
        assert paths[1] in removed
    finally:
        live.communicate(b"", timeout=30)
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_an_unlocked_region_named_with_this_pid_but_not_made_here_is_swept(
    tmp_path: Path,
) -> None:
    """A client restarted in a fresh pid namespace (a container sharing /dev/shm) may get
    the pid of the one that crashed; the crashed one's region is swept, not kept as its
    own, so crash-restarts leave no regions (64 MiB each, by the README's example) in RAM."""
    orphan = tmp_path / f"carpool-{os.getpid()}-0123abcd"
    orphan.write_bytes(MAGIC + bytes(64))
    assert sweep_orphans(str(tmp_path), min_age_s=0.0) == [str(orphan)]


def test_a_name_with_a_pid_no_process_can_have_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """os.kill(4000000000, 0) raises OverflowError, not OSError: such a file (anyone may
    make one in /dev/shm) is swept like any orphan and stops no region from being made."""
    odd = tmp_path / "carpool-4000000000-abcdef"
    odd.write_bytes(MAGIC + bytes(64))
    assert sweep_orphans(str(tmp_path), min_age_s=0.0) == [str(odd)]
