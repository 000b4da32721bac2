"""worker/tensorrt/cache.py: plan keys (each field changes the key), lookups that miss
with the reason for a stale, foreign or damaged plan, the store, the timing cache's path,
and the L4T release read from /etc/nv_tegra_release."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from carpool.worker.tensorrt import cache
from carpool.worker.tensorrt.cache import Device, Hit, Miss, PlanKey, parse_l4t, read_l4t

H200 = Device("NVIDIA H200", (9, 0))
ORIN = Device("Orin", (8, 7), "R36.4.3")
PROFILE = [["x", [1, 3, 224, 224], [8, 3, 224, 224], [8, 3, 224, 224]]]
KEY = PlanKey(
    onnx_sha256="ab" * 32,
    trt_version="10.3.0",
    device=ORIN,
    profiles=(PROFILE,),
    precision={"precision": "fp16", "strongly_typed": False, "builder_flags": ["FP16"]},
)

CHANGED = {
    "onnx_sha256": dataclasses.replace(KEY, onnx_sha256="cd" * 32),
    "trt_version": dataclasses.replace(KEY, trt_version="10.3.0.1"),
    "gpu_name": dataclasses.replace(KEY, device=dataclasses.replace(ORIN, name="Orin Nano")),
    "compute_capability": dataclasses.replace(
        KEY, device=dataclasses.replace(ORIN, compute_capability=(8, 6))
    ),
    "l4t": dataclasses.replace(KEY, device=dataclasses.replace(ORIN, l4t="R36.3.0")),
    "profiles": dataclasses.replace(
        KEY, profiles=([["x", [1, 3, 224, 224], [4, 3, 224, 224], [8, 3, 224, 224]]],)
    ),
    "precision": dataclasses.replace(
        KEY, precision={"precision": "fp32", "strongly_typed": False, "builder_flags": []}
    ),
}


def test_the_key_is_stable_and_names_every_field() -> None:
    assert KEY.digest() == dataclasses.replace(KEY).digest()
    assert set(KEY.fields()) == set(CHANGED)
    assert len(KEY.digest()) == 64


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_changing_any_key_field_misses_the_stored_plan(tmp_path: Path, field: str) -> None:
    cache.store(tmp_path, KEY, b"plan bytes")
    other = CHANGED[field]
    assert other.digest() != KEY.digest()
    found = cache.lookup(tmp_path, other)
    assert isinstance(found, Miss)
    # the reason names what the plan that is there was built for
    assert field in found.reason
    assert isinstance(cache.lookup(tmp_path, KEY), Hit)


def test_a_stored_plan_is_found_with_its_sidecar(tmp_path: Path) -> None:
    path = cache.store(tmp_path, KEY, b"plan bytes")
    assert path == tmp_path / "plans" / f"{KEY.digest()}.plan"
    assert cache.lookup(tmp_path, KEY) == Hit(path)
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["key"]["trt_version"] == "10.3.0"
    assert sidecar["key"]["l4t"] == "R36.4.3"
    assert sidecar["plan_bytes"] == len(b"plan bytes")
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files


def test_an_empty_cache_is_a_miss_saying_so(tmp_path: Path) -> None:
    found = cache.lookup(tmp_path, KEY)
    assert isinstance(found, Miss)
    assert found.reason.startswith(f"no plan in {tmp_path / 'plans'}")


def _damage(path: Path, how: str) -> None:
    sidecar = path.with_suffix(".json")
    if how == "no sidecar":
        sidecar.unlink()
    elif how == "corrupt sidecar":
        sidecar.write_text("{not json")
    elif how == "other fields":
        data = json.loads(sidecar.read_text())
        data["key"]["trt_version"] = "11.4.0.106"
        sidecar.write_text(json.dumps(data))
    elif how == "old format":
        data = json.loads(sidecar.read_text())
        data["format"] = 0
        sidecar.write_text(json.dumps(data))
    elif how == "truncated plan":
        path.write_bytes(b"plan")


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("no sidecar", "has no readable sidecar"),
        ("corrupt sidecar", "has no readable sidecar"),
        ("other fields", "sidecar names other fields (trt_version '11.4.0.106')"),
        ("old format", "sidecar names other fields"),
        ("truncated plan", "does not hash to its sidecar's plan_sha256"),
    ],
)
def test_a_damaged_or_foreign_plan_is_a_miss_never_a_hit(tmp_path: Path, how, words) -> None:
    path = cache.store(tmp_path, KEY, b"plan bytes")
    _damage(path, how)
    found = cache.lookup(tmp_path, KEY)
    assert isinstance(found, Miss)
    assert words in found.reason
    assert "not loaded" in found.reason


def test_storing_again_replaces_a_damaged_plan(tmp_path: Path) -> None:
    path = cache.store(tmp_path, KEY, b"plan bytes")
    _damage(path, "truncated plan")
    cache.store(tmp_path, KEY, b"new plan bytes")
    assert cache.lookup(tmp_path, KEY) == Hit(path)
    assert path.read_bytes() == b"new plan bytes"


def test_the_timing_cache_is_filed_by_release_and_device(tmp_path: Path) -> None:
    assert cache.timing_cache_path(tmp_path, "10.3.0", ORIN) == (
        tmp_path / ".timing" / "trt-10.3.0-orin-sm87-r36.4.3.cache"
    )
    assert cache.timing_cache_path(tmp_path, "11.4.0.106", H200).name == (
        "trt-11.4.0.106-nvidia-h200-sm90.cache"
    )


# /etc/nv_tegra_release as JetPack releases write it (first line; the rest varies).
JETPACK_6_2 = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\nTARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
JETPACK_5_1_2 = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)
JETPACK_6_0 = "# R36 (release), REVISION: 3, GCID: 36191598, BOARD: generic, EABI: aarch64\n"


@pytest.mark.parametrize(
    ("text", "release"),
    [
        (JETPACK_6_2, "R36.4.3"),
        (JETPACK_5_1_2, "R35.4.1"),
        (JETPACK_6_0, "R36.3"),
        ("", None),
        ("Ubuntu 22.04\n", None),
    ],
)
def test_the_l4t_release_is_read_from_nv_tegra_release(text, release) -> None:
    assert parse_l4t(text) == release


def test_reading_l4t_off_a_jetson_is_none(tmp_path: Path) -> None:
    assert read_l4t(tmp_path / "absent") is None
    (tmp_path / "nv_tegra_release").write_text(JETPACK_6_2)
    assert read_l4t(tmp_path / "nv_tegra_release") == "R36.4.3"
