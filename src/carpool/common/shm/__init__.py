"""carpool.common.shm: shared-memory tensors for clients and workers on one host (§5.4, §5.5).

A client that shares ``/dev/shm`` with the workers can put a large input tensor into a
region of its own and send only a reference (region, offset, key) through the broker; the
worker reads the bytes straight from the region into its batch buffer. Large outputs can
come back the same way, through a ring the worker owns. The payload then never crosses a
socket: neither the broker's process nor the kernel's socket buffers see it. This is the
idea of Triton's system shared memory, without a registration step: a region is a file
in ``/dev/shm`` whose name starts with ``carpool-``.

- :class:`ShmArena` (client side) creates one region, places tensors in it and frees
  them when the request is answered. It never shrinks or truncates its region.
- :class:`ShmRing` (worker side) is the output ring; byte-range locks keep its writer and
  its readers apart, and the writer never waits.
- :class:`RegionReader` reads with ``preadv`` from file descriptors it keeps open, never
  through a mapping: a region that is shorter than a reference claims gives a short read
  (an error for that one request), not a SIGBUS. Workers use it for inputs, clients for
  outputs (:meth:`RegionReader.read_output`).
- Regions are allocated in full when made (``posix_fallocate``), so that a full tmpfs
  is an error then, not later; they are written with ``pwrite``, never through a
  mapping (a region truncated under its owner must not be a SIGBUS), and may not be
  group- or world-writable. An owner holds a shared ``flock`` on its region while it
  lives; :func:`sweep_orphans` removes this user's regions nobody holds.

Trust: a worker reads only files named ``/dev/shm/carpool-*`` that it may open (file
permissions decide; the arena creates its region ``0600`` unless told otherwise), never
follows a symlink, and only reads. A region starts with a header holding a random key,
and a reference must carry that key: region names are visible to every user of the host,
the key only to those who can read the region, so one client cannot make a worker read
another's region.

Modules: :mod:`.regions` (creation, the sweep of orphans, the region base), :mod:`.arena`,
:mod:`.ring`, :mod:`.reader`. The references themselves and their wire form are pure
protocol: :mod:`carpool.common.protocol.refs` (re-exported here).
"""

from carpool.common.protocol.refs import (
    KEY_BYTES,
    MAX_OFFSET,
    MAX_REF_BYTES,
    REGION_PREFIX,
    RING_TAG,
    OutputRef,
    ShmRef,
    output_ref_wire,
    parse_output_ref,
    parse_ref,
    ref_wire,
    valid_region,
)
from carpool.common.shm.arena import ShmArena
from carpool.common.shm.reader import RegionReader
from carpool.common.shm.regions import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    SHM_DIR,
    OwnedRegion,
    ShmError,
    available,
    sweep_orphans,
)
from carpool.common.shm.ring import ShmRing

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "KEY_BYTES",
    "MAGIC",
    "MAX_OFFSET",
    "MAX_REF_BYTES",
    "REGION_PREFIX",
    "RING_TAG",
    "SHM_DIR",
    "OutputRef",
    "OwnedRegion",
    "RegionReader",
    "ShmArena",
    "ShmError",
    "ShmRef",
    "ShmRing",
    "available",
    "output_ref_wire",
    "parse_output_ref",
    "parse_ref",
    "ref_wire",
    "sweep_orphans",
    "valid_region",
]
