"""worker/tensorrt/versions.py: what a TensorRT release can do, from its version string."""

from __future__ import annotations

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.tensorrt.versions import TrtVersion


@pytest.mark.parametrize(
    ("text", "parts", "flags", "strong"),
    [
        ("10.3.0", (10, 3, 0, 0), True, False),  # JetPack 6
        ("10.16.1.11", (10, 16, 1, 11), True, False),
        ("11.0.0.5", (11, 0, 0, 5), False, True),
        ("11.4.0.106", (11, 4, 0, 106), False, True),
        ("11.4.1.post1", (11, 4, 1, 0), False, True),
    ],
)
def test_a_version_says_which_precision_api_it_has(text, parts, flags, strong) -> None:
    version = TrtVersion.parse(text)
    assert (version.major, version.minor, version.patch, version.build) == parts
    assert version.precision_flags is flags
    assert version.always_strongly_typed is strong
    assert version.progress_monitor
    assert str(version) == text


@pytest.mark.parametrize(
    ("text", "words"),
    [("8.5.2.2", "older than 10.3"), ("10.2.0", "older"), ("ten", "not MAJOR.MINOR")],
)
def test_old_or_unreadable_versions_are_refused(text, words) -> None:
    with pytest.raises(ConfigError, match=words):
        TrtVersion.parse(text)
