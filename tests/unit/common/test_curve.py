"""common/curve.py and the broker's CURVE settings: key files, modes, allow-lists; the
rate-limited log of refusals (common/ratelog.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from carpool.broker.config import CurveConfig
from carpool.common.curve import (
    client_keys,
    create_keypair,
    load_allowed,
    load_keypair,
    load_public,
)
from carpool.common.errors import ConfigError


def test_a_pair_loads_from_its_files_and_a_public_key_from_z85_text(tmp_path: Path) -> None:
    public, secret = create_keypair(tmp_path, "a")
    pair = load_keypair(secret)
    assert load_public(public) == pair.public
    assert load_public(pair.public.decode()) == pair.public
    assert pair.secret.decode() not in repr(pair)


def test_a_secret_key_given_as_text_is_refused_naming_the_setting(tmp_path: Path) -> None:
    public, secret = create_keypair(tmp_path, "a")
    text = load_keypair(secret).secret.decode()
    with pytest.raises(ConfigError, match=r"curve\.server_key must be the path") as raised:
        load_keypair(text, "curve.server_key")
    assert text not in str(raised.value)
    with pytest.raises(ConfigError, match=r"ClientOptions\.curve_key must be the path"):
        client_keys(str(public), text, "ClientOptions.curve_key")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_secret_file_others_may_read_is_refused_naming_file_and_mode(
    tmp_path: Path, mode: int
) -> None:
    _, secret = create_keypair(tmp_path, "a")
    os.chmod(secret, mode)
    with pytest.raises(ConfigError, match=rf"{secret} has mode {mode:04o}"):
        load_keypair(secret)
    os.chmod(secret, 0o400)
    load_keypair(secret)


def test_a_public_file_is_no_key_pair(tmp_path: Path) -> None:
    public, _ = create_keypair(tmp_path, "a")
    os.chmod(public, 0o600)
    with pytest.raises(ConfigError, match="no secret key"):
        load_keypair(public)


def test_an_allow_list_holds_the_public_keys_of_its_directory(tmp_path: Path) -> None:
    keys = {load_public(create_keypair(tmp_path / "d", n)[0]) for n in ("a", "b")}
    assert load_allowed(tmp_path / "d") == keys
    with pytest.raises(ConfigError, match="not a directory"):
        load_allowed(tmp_path / "missing")


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o1777], ids=oct)
def test_an_allow_list_directory_others_may_write_is_refused_naming_it_and_its_mode(
    tmp_path: Path, mode: int
) -> None:
    create_keypair(tmp_path / "d", "a")
    os.chmod(tmp_path / "d", mode)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'd'} has mode {mode & 0o7777:04o}"):
        load_allowed(tmp_path / "d")
    os.chmod(tmp_path / "d", 0o755)
    assert len(load_allowed(tmp_path / "d")) == 1


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=oct)
def test_an_allow_listed_key_file_others_may_write_is_refused_naming_it_and_its_mode(
    tmp_path: Path, mode: int
) -> None:
    public, _ = create_keypair(tmp_path / "d", "a")
    os.chmod(public, mode)
    with pytest.raises(ConfigError, match=rf"{public} has mode {mode:04o}"):
        load_allowed(tmp_path / "d")


def test_keygen_never_replaces_a_pair(tmp_path: Path) -> None:
    create_keypair(tmp_path, "a")
    with pytest.raises(ConfigError, match="exists already"):
        create_keypair(tmp_path, "a")


def test_client_keys_are_both_or_none(tmp_path: Path) -> None:
    assert client_keys("", "") is None
    public, secret = create_keypair(tmp_path, "a")
    with pytest.raises(ConfigError, match="both"):
        client_keys(str(public), "")
    keys = client_keys(str(public), str(secret))
    assert keys is not None
    assert keys.server == keys.own.public == zmq.curve_public(keys.own.secret)


def test_curve_settings_need_their_keys_and_two_allow_lists(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enabled needs server_key, clients, workers"):
        CurveConfig(enabled=True)
    with pytest.raises(ConfigError, match="different directories"):
        CurveConfig(enabled=True, server_key="k", clients=str(tmp_path), workers=f"{tmp_path}/.")


@pytest.mark.parametrize("shared", ["clients", "workers"])
def test_the_operators_list_is_a_directory_of_its_own(tmp_path: Path, shared: str) -> None:
    clients, workers = str(tmp_path / "c"), str(tmp_path / "w")
    same = f"{clients if shared == 'clients' else workers}/."
    with pytest.raises(ConfigError, match=f"operators and {shared} must be different"):
        CurveConfig(enabled=True, server_key="k", clients=clients, workers=workers, operators=same)
    CurveConfig(
        enabled=True, server_key="k", clients=clients, workers=workers, operators=f"{tmp_path}/o"
    )
