"""gpu_standin.py: the TensorRT engine's CUDA pipeline on a real GPU, with a CuPy kernel
standing in for TensorRT (for ``bench/gpu_check.py`` on a GPU machine without TensorRT).

:class:`StandinPlan` implements the engine's tensorrt adapter protocols
(:mod:`carpool.worker.engines.trt_slots`): one input ``x`` float32 ``[B, W]``, one output
``y = 2x + 1``; its "execute_async_v3" launches a kernel on the context's stream that
reads and writes the device buffers the engine set and spins ``iters`` times per element,
so a batch takes device time. Everything else — profiles, buffers, contexts in turn,
copies, events, busy time — is the real :class:`~carpool.worker.engines.trt.TensorRTEngine`
on the real CUDA layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.worker.engines.trt_plan import Shape, TensorIO
from carpool.worker.engines.trt_slots import OutputStore

KERNEL = r"""
extern "C" __global__ void standin(const float* x, float* y, int n, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], acc = v;
    for (int k = 0; k < iters; ++k) acc = acc * 0.9999999f + 1e-7f;
    y[i] = 2.0f * v + 1.0f;
    if (acc == -12345.0f) y[i] = acc;  // keeps the loop
}
"""


class StandinContext:
    def __init__(self, plan: StandinPlan) -> None:
        self._plan = plan
        self._shape: Shape = (1, 1)
        self._addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, index: int, stream: int) -> None:
        pass

    def set_input_shape(self, name: str, shape: Shape) -> None:
        self._shape = shape

    def get_tensor_shape(self, name: str) -> Shape:
        return self._shape

    def get_max_output_size(self, name: str) -> int:
        raise NotImplementedError("the stand-in has no data-dependent output")

    def set_tensor_address(self, name: str, ptr: int) -> None:
        self._addresses[name] = ptr

    def set_output_allocator(self, name: str, store: OutputStore) -> None:
        raise NotImplementedError("the stand-in has no data-dependent output")

    def execute_async_v3(self, stream: int) -> bool:
        cp = self._plan.cp
        n = int(np.prod(self._shape))
        blocks = (n + 255) // 256
        with cp.cuda.ExternalStream(stream):
            self._plan.kernel(
                (blocks,),
                (256,),
                (
                    np.uint64(self._addresses["x"]),
                    np.uint64(self._addresses["y"]),
                    np.int32(n),
                    np.int32(self._plan.iters),
                ),
            )
        return True


class StandinPlan:
    """One profile: batch 1..``max_batch`` (opt ``max_batch``), width ``width``."""

    def __init__(self, *, width: int = 4096, max_batch: int = 32, iters: int = 2000) -> None:
        import cupy as cp

        self.cp: Any = cp
        self.kernel = cp.RawKernel(KERNEL, "standin")
        self.width, self.max_batch, self.iters = width, max_batch, iters

    def tensors(self) -> list[TensorIO]:
        return [TensorIO("x", True, "float32", (-1, -1)), TensorIO("y", False, "float32", (-1, -1))]

    def num_optimization_profiles(self) -> int:
        return 1

    def get_tensor_profile_shape(self, name: str, index: int) -> tuple[Shape, Shape, Shape]:
        w = self.width
        return (1, w), (self.max_batch, w), (self.max_batch, w)

    def create_execution_context(self) -> StandinContext:
        return StandinContext(self)

    def close(self) -> None:
        pass
