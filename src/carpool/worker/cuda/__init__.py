"""cuda: the CUDA layer the TensorRT engine runs on (:mod:`.base` is the interface).

:func:`open_cuda` picks the binding that imports: cuda-python first (the default), then
pycuda. The object it returns belongs to the calling thread.
"""

from __future__ import annotations

from carpool.worker.cuda.base import Cuda, CudaUnavailable

#: The bindings in the order they are tried.
BINDINGS = ("cuda-python", "pycuda")


def open_cuda(device: int = 0, bindings: tuple[str, ...] = BINDINGS) -> Cuda:
    """The first of ``bindings`` that imports and finds ``device``, owned by this thread.

    Raises:
        CudaUnavailable: none did; the message gives each one's reason.
    """
    reasons = []
    for binding in bindings:
        cuda, reason = _try_open(binding, device)
        if cuda is not None:
            return cuda
        reasons.append(f"{binding}: {reason}")
    raise CudaUnavailable("; ".join(reasons))


def _try_open(binding: str, device: int) -> tuple[Cuda | None, str]:
    try:
        if binding == "cuda-python":
            from carpool.worker.cuda.runtime import open_runtime

            return open_runtime(device), ""
        if binding == "pycuda":
            from carpool.worker.cuda.pycuda_driver import open_pycuda

            return open_pycuda(device), ""
    except CudaUnavailable as exc:
        return None, str(exc)
    return None, "unknown CUDA binding"
