"""profile_text.py: the text of a ``--profile`` or ``--batch`` flag, parsed (the same
text as a ``[tensorrt]`` table's ``profiles`` and ``batches``). Pure, and imports nothing
of the worker: the worker's config checks its tables with it, and
:mod:`carpool.worker.tensorrt.profiles` makes profiles of what it returns."""

from __future__ import annotations

from carpool.common.errors import ConfigError

#: A tensor's shape, dim 0 the batch.
Shape = tuple[int, ...]


def _dims(text: str, what: str) -> Shape:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a shape such as 1x3x224x224") from None
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"{what}: {text!r} has a dim below 1")
    return dims


def parse_profile(text: str) -> dict[str, tuple[Shape, Shape, Shape]]:
    """One ``--profile`` flag: ``NAME=MIN:OPT:MAX[,NAME=...]``, each shape ``AxBxC``.

    Raises:
        ConfigError: it does not read so.
    """
    out: dict[str, tuple[Shape, Shape, Shape]] = {}
    for part in text.split(","):
        name, eq, shapes = part.strip().partition("=")
        parts = shapes.split(":")
        if not eq or not name or len(parts) != 3:
            raise ConfigError(f"--profile {text!r}: each input is NAME=MIN:OPT:MAX")
        what = f"--profile {name}"
        lo, opt, hi = (_dims(p, what) for p in parts)
        out[name] = (lo, opt, hi)
    return out


def parse_batch(text: str) -> tuple[int, int, int]:
    """One ``--batch MIN:OPT:MAX`` flag.

    Raises:
        ConfigError: not three ints with 1 <= MIN <= OPT <= MAX.
    """
    try:
        lo, opt, hi = (int(p) for p in text.split(":"))
    except ValueError:
        raise ConfigError(f"--batch {text!r} is not MIN:OPT:MAX") from None
    if not 1 <= lo <= opt <= hi:
        raise ConfigError(f"--batch {text!r}: needs 1 <= MIN <= OPT <= MAX")
    return lo, opt, hi
