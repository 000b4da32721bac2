"""A recording fake of the TensorRT adapter (:mod:`carpool.worker.engines.trt_slots`'s
protocols) on :class:`~carpool.worker.cuda.fake.FakeCuda`.

Its model: ``x`` float32 ``[B, W]`` → ``y = 2x + 1`` (same shape) and, with ``positions``,
an int32 ``pos`` ``[B, W]`` whose shape the plan leaves open (a TensorRT output of
data-dependent shape, which the engine learns through its output allocator once the kernel
ran): each sample's indices of its positive values, -1 past them. Kernels read and write
the fake device memory at the addresses the engine set, so a wrong address or a missing
copy shows in the outputs. ``bound_bytes`` sets what TensorRT gives as the bound of
``pos`` (a run may then ask its allocator for more); ``shape_tensor`` adds an input that
TensorRT reads on the host (a shape tensor).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.worker.cuda.fake import FakeCuda
from carpool.worker.engines.base import BadInput
from carpool.worker.engines.trt_plan import Shape, TensorIO
from carpool.worker.engines.trt_slots import OutputStore

Limits = tuple[Shape, Shape, Shape]

#: Two profiles: small batches, and large ones; W from 4 to 8 in both.
PROFILES: list[Limits] = [((1, 4), (2, 8), (4, 8)), ((1, 4), (8, 8), (16, 8))]


def expected(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """What the fake model computes (the oracle)."""
    out = {"y": (2 * x + 1).astype(np.float32)}
    rows = [np.flatnonzero(row > 0) for row in x]
    pos = np.full(x.shape, -1, np.int32)
    for i, r in enumerate(rows):
        pos[i, : len(r)] = r
    out["pos"] = pos
    return out


class FakeContext:
    def __init__(self, plan: FakePlan) -> None:
        self.plan = plan
        self.calls: list[tuple[Any, ...]] = []
        self.profile = 0
        self.shapes: dict[str, Shape] = {}
        self.addresses: dict[str, int] = {}
        self.stores: dict[str, OutputStore] = {}

    def set_optimization_profile_async(self, index: int, stream: int) -> None:
        self.calls.append(("profile", index, stream))
        self.profile = index

    def set_input_shape(self, name: str, shape: Shape) -> None:
        low, _, high = self.plan.profiles[self.profile]
        if not all(lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)):
            raise BadInput(f"shape {shape} outside profile {self.profile}")
        self.calls.append(("shape", name, shape))
        self.shapes[name] = shape

    def get_tensor_shape(self, name: str) -> Shape:
        x = self.shapes["x"]
        return x if name == "y" else (x[0], -1)

    def get_max_output_size(self, name: str) -> int:
        assert name == "pos"
        batch, width = self.shapes["x"]
        bound = self.plan.bound_bytes
        return batch * width * 4 if bound is None else bound

    def set_tensor_address(self, name: str, ptr: int) -> None:
        self.calls.append(("address", name, ptr))
        self.addresses[name] = ptr

    def set_output_allocator(self, name: str, store: OutputStore) -> None:
        self.stores[name] = store

    def execute_async_v3(self, stream: int) -> bool:
        self.calls.append(("execute", stream, self.shapes["x"]))
        if self.plan.fail:
            return False
        cuda, shape = self.plan.cuda, self.shapes["x"]
        nbytes = int(np.prod(shape)) * 4
        x_ptr, y_ptr = self.addresses["x"], self.addresses["y"]

        def kernel() -> None:
            x = cuda.device_array(x_ptr)[:nbytes].view(np.float32).reshape(shape)
            cuda.device_array(y_ptr)[:nbytes].view(np.float32)[:] = (2 * x + 1).ravel()

        cuda.launch(stream, "engine", self.plan.cost_s, kernel)
        if "pos" in self.stores:  # TensorRT runs up to the shape, then asks for memory
            cuda.drain(stream)
            x = cuda.device_array(x_ptr)[:nbytes].view(np.float32).reshape(shape)
            pos = expected(x)["pos"]
            store = self.stores["pos"]
            ptr = store.reallocate("pos", pos.nbytes)
            store.notify_shape("pos", pos.shape)
            cuda.device_array(ptr)[: pos.nbytes] = pos.view(np.uint8).ravel()
        return True


class FakePlan:
    def __init__(
        self,
        cuda: FakeCuda,
        profiles: list[Limits] | None = None,
        *,
        positions: bool = False,
        cost_s: float = 0.010,
        bound_bytes: int | None = None,
        shape_tensor: bool = False,
    ) -> None:
        self.cuda = cuda
        self.profiles = PROFILES if profiles is None else profiles
        self.positions = positions
        self.bound_bytes = bound_bytes
        self.shape_tensor = shape_tensor
        self.cost_s = cost_s
        self.fail = False
        self.contexts: list[FakeContext] = []
        self.closed = False

    def tensors(self) -> list[TensorIO]:
        io = [TensorIO("x", True, "float32", (-1, -1)), TensorIO("y", False, "float32", (-1, -1))]
        if self.positions:
            io.append(TensorIO("pos", False, "int32", (-1, -1)))
        if self.shape_tensor:
            io.append(TensorIO("size", True, "int32", (2,), on_host=True))
        return io

    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_profile_shape(self, name: str, index: int) -> Limits:
        assert name == "x"
        return self.profiles[index]

    def create_execution_context(self) -> FakeContext:
        context = FakeContext(self)
        self.contexts.append(context)
        return context

    def close(self) -> None:
        self.closed = True
