"""Fake modules in ``sys.modules`` for the length of a ``with`` (the fakes' ``installed``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def modules_replaced(modules: Mapping[str, Any]) -> Iterator[None]:
    """``sys.modules`` with ``modules`` in place (a name mapped to None: its import
    fails), and as it was afterwards."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
