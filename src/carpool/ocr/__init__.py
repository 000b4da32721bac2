"""carpool.ocr: a text-reading application on the carpool SDK (the PP-OCRv4 detector and
recognizer of the built-in catalogue, docs/models.md).

Modules, pure where they can be:

- :mod:`~carpool.ocr.render`: seeded camera frames with known text lines (Pillow).
- :mod:`~carpool.ocr.detect`: the detector's input and its probability map to boxes (DB
  post-processing, numpy connected components).
- :mod:`~carpool.ocr.recognize`: boxes to the recognizer's inputs, CTC greedy decoding.
- :mod:`~carpool.ocr.accuracy`: edit distance, character error rate, lines matched to boxes.
- :mod:`~carpool.ocr.pipeline`: :class:`~carpool.ocr.pipeline.OcrPipeline` over a
  transport, ONNX Runtime in process or a carpool fleet through a ``Client``.
"""
