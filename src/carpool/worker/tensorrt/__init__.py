"""tensorrt: building TensorRT plans from a model repository, and caching them.

Pure modules decide; one adapter (:mod:`carpool.worker.engines.trt`) calls
TensorRT. :mod:`.versions` reads what a TensorRT release can do from its version string,
:mod:`.precision` turns a requested precision into network and builder flags,
:mod:`.profile_text` parses ``--profile`` and ``--batch`` text, :mod:`.profiles` derives
optimization profiles from a model's buckets and shape rules (and picks one for a batch),
:mod:`.device` names a GPU (and a Jetson's L4T release), :mod:`.cache` keys and finds
plans, :mod:`.probe` looks for a GPU before any TensorRT object exists (its child,
:mod:`.probe_child`, asks CUDA), :mod:`.build` runs a build through the adapter and
:mod:`.command` is ``carpool build-engine``. Nothing here imports tensorrt.
"""
