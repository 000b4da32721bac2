"""Loading a bench/ script as a module in a test (its ``main`` is not run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_script(script: str) -> ModuleType:
    """``bench/<script>`` as a module named ``bench_<name>``."""
    name = f"bench_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up while it executes)
    try:
        spec.loader.exec_module(module)  # scripts only run under `if __name__ == "__main__"`
    finally:
        del sys.modules[name]
    return module
