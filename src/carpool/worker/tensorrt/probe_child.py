"""probe_child.py: the GPU probe's child process; its source runs as ``python -c``.

It asks CUDA for the device the worker's CUDA layer (:mod:`carpool.worker.cuda`) will
open, through the same bindings in the same order: cuda-python's runtime API
(``cuda.bindings.runtime``, or ``cuda.cudart`` before cuda-python 12.6.1), then pycuda.
CUDA honours ``CUDA_VISIBLE_DEVICES``, so device 0 is the first visible one; NVML is never
asked here, since it ignores that variable and numbers devices in PCI order. It prints
one JSON line: the binding and its version, the CUDA runtime's and the driver's versions
(even when no device answers), then the device's name, compute capability, PCI bus id
and UUID (NVML's ``GPU-…`` form), or ``error``: why no device answered.

Standard library only, besides the binding; Python 3.10. Nothing of carpool is imported:
the parent (:mod:`.probe`) reads this file and runs it in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from importlib import metadata
from typing import Any

#: The CUDA runtime's error numbers that have a reason of their own.
INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
NO_DEVICE = 100  # cudaErrorNoDevice
#: What to install where the binding's runtime is newer than the driver.
DRIVER_FIX = (
    "install carpool[jetpack6] on JetPack 6, or carpool[cu12] with a CUDA 12 driver (docs/gpu.md)"
)


class NotInstalled(Exception):
    """The binding's package is not installed."""


class NoDevice(Exception):
    """The binding imports but no device answers (the message says why)."""


def version_text(number: int) -> str:
    """CUDA's version number as ``major.minor`` (12090 → "12.9"); "" for 0 (no driver)."""
    return f"{number // 1000}.{number % 1000 // 10}" if number > 0 else ""


def uuid_text(raw: bytes) -> str:
    """A device's 16 UUID bytes as NVML writes them (``GPU-`` then 8-4-4-4-12 hex digits);
    "" when they are not 16 bytes or all zero."""
    raw = bytes(raw)
    return "GPU-" + str(uuid.UUID(bytes=raw)) if len(raw) == 16 and any(raw) else ""


def c_text(raw: Any) -> str:
    """A C string from the bindings (bytes up to the first NUL) as text."""
    if isinstance(raw, bytes):
        return raw.split(b"\0", 1)[0].decode(errors="replace")
    return str(raw)


def _named(module: Any, *distributions: str) -> str:
    """The binding as "DISTRIBUTION VERSION": the first of ``distributions`` installed (the
    first named where none is, as for a package found on PYTHONPATH alone), and the
    module's ``__version__``, else that distribution's version."""
    for name in distributions:
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed = metadata.version(name)
            break
    else:
        name, installed = distributions[0], "?"
    found = getattr(module, "__version__", None)
    return f"{name} {found if isinstance(found, str) else installed}"


def _not_visible() -> NoDevice:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    told = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    return NoDevice(f"no visible CUDA device{told}")


def import_runtime() -> tuple[Any, str]:
    """cuda-python's runtime module and the binding's name and version.

    Raises:
        NotInstalled: neither layout is there; ImportError: it is, but does not import.
    """
    try:
        from cuda.bindings import runtime
    except ModuleNotFoundError as exc:
        if exc.name == "cuda":
            raise NotInstalled from None
        if exc.name != "cuda.bindings":
            raise
    else:
        import cuda.bindings

        # cuda-python 12.6.1 to 12.6.2.post1 ship cuda.bindings in the cuda-python wheel.
        return runtime, _named(cuda.bindings, "cuda-bindings", "cuda-python")
    try:
        import cuda.cudart as cudart  # cuda-python 12.x before cuda.bindings (12.6.1)
    except ModuleNotFoundError as exc:
        if exc.name in ("cuda", "cuda.cudart"):
            raise NotInstalled from None
        raise
    import cuda

    return cudart, _named(cuda, "cuda-python")


def ask_runtime(rt: Any, binding: str, answer: dict[str, Any]) -> dict[str, Any]:
    """Device 0 through cuda-python's runtime ``rt``; the versions go into ``answer`` as
    they are read.

    Raises:
        NoDevice: no driver, one too old for this runtime, or no visible device.
    """

    def ok(call: str, result: Any) -> Any:
        err, *rest = result
        if int(err) != 0:
            raise NoDevice(f"{call}: {getattr(err, 'name', int(err))}")
        return rest[0] if len(rest) == 1 else rest

    try:
        answer["runtime"] = version_text(ok("cudaRuntimeGetVersion", rt.cudaRuntimeGetVersion()))
        driver = ok("cudaDriverGetVersion", rt.cudaDriverGetVersion())
        answer["driver"] = version_text(driver)
        if driver == 0:
            raise NoDevice("no CUDA driver (cudaDriverGetVersion: 0)")
        err, count = rt.cudaGetDeviceCount()
        if int(err) == INSUFFICIENT_DRIVER:
            raise NoDevice(
                f"{binding} has CUDA runtime {answer['runtime']}, which needs a newer driver "
                f"than this one (CUDA {answer['driver']}, cudaErrorInsufficientDriver): "
                + DRIVER_FIX
            )
        if int(err) == NO_DEVICE or (int(err) == 0 and count < 1):
            raise _not_visible()
        ok("cudaGetDeviceCount", (err, count))
        props = ok("cudaGetDeviceProperties", rt.cudaGetDeviceProperties(0))
        bus = ok("cudaDeviceGetPCIBusId", rt.cudaDeviceGetPCIBusId(64, 0))
    except (RuntimeError, OSError) as exc:
        # cuda-python up to 12.6.0 raises from its driver calls where there is no driver.
        raise NoDevice(f"no CUDA driver ({exc})") from None
    return {
        "count": int(count),
        "name": c_text(props.name),
        "cc": [int(props.major), int(props.minor)],
        "pci_bus_id": c_text(bus),
        "uuid": uuid_text(props.uuid.bytes),
    }


def ask_cuda_python(answer: dict[str, Any]) -> dict[str, Any]:
    """Device 0 through cuda-python (either layout)."""
    rt, answer["binding"] = import_runtime()
    return ask_runtime(rt, answer["binding"], answer)


def ask_pycuda(answer: dict[str, Any]) -> dict[str, Any]:
    """Device 0 through pycuda, which gives no UUID (NVML is then opened by PCI bus id)."""
    try:
        import pycuda
        import pycuda.driver as drv
    except ModuleNotFoundError as exc:
        if exc.name in ("pycuda", "pycuda.driver"):
            raise NotInstalled from None
        raise
    answer["binding"] = (
        f"pycuda {pycuda.VERSION_TEXT}"
        if hasattr(pycuda, "VERSION_TEXT")
        else _named(pycuda, "pycuda")
    )
    answer["runtime"] = ".".join(str(part) for part in drv.get_version()[:2])
    try:
        drv.init()
        answer["driver"] = version_text(drv.get_driver_version())
        count = drv.Device.count()
        if count < 1:
            raise _not_visible()
        dev = drv.Device(0)
        found = {"name": dev.name(), "cc": list(dev.compute_capability())}
        return {"count": count, **found, "pci_bus_id": dev.pci_bus_id(), "uuid": ""}
    except drv.Error as exc:
        raise NoDevice(str(exc)) from None


#: The bindings in the worker's order (carpool.worker.cuda.BINDINGS).
ASKS: tuple[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]], ...] = (
    ("cuda-python", ask_cuda_python),
    ("pycuda", ask_pycuda),
)


def answer() -> dict[str, Any]:
    """The first binding's device, with its versions; else why none answered, with the
    versions of the first binding that imported."""
    why: list[str] = []
    first: dict[str, Any] = {}
    for package, ask in ASKS:
        told: dict[str, Any] = {}
        try:
            device = ask(told)
        except NotInstalled:
            why.append(f"{package} is not installed")
        except ImportError as exc:
            why.append(f"{package} does not import ({exc})")
        except NoDevice as exc:
            why.append(f"{told.get('binding', package)}: {exc}")
        except Exception as exc:
            why.append(f"{told.get('binding', package)}: {type(exc).__name__}: {exc}")
        else:
            return {**told, **device}
        first = first or told
    return {**first, "error": "; ".join(why)}


if __name__ == "__main__":
    print(json.dumps(answer()))
