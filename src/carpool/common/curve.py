"""curve.py: CURVE key pairs and allow-lists from files, and the socket options they set.

Keys are Z85 text (40 characters), in the certificate files pyzmq's ``zmq.auth`` writes:
``NAME.key`` holds the public key, ``NAME.key_secret`` both keys. A secret key is read
from its file only, never taken as text (text would show in ``ps`` and config files no
mode guards). A secret file must be readable by its owner only (mode 0600 or 0400):
:func:`load_keypair` refuses one that its group or others may read, naming the file and
its mode. An allow-list is a directory of public ``*.key`` files
(``zmq.auth.load_certificates``); :func:`load_allowed` refuses one whose directory or
key files its group or others may write, as sshd's ``StrictModes`` does.

The broker's side (the ZAP authenticator, its allow-lists) is
:mod:`carpool.broker.auth`; this module is what every side shares, clients and workers
included (:func:`connect_keys` before a DEALER connects).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
import zmq.utils.z85

from carpool.common.errors import ConfigError

__all__ = [
    "KEY_CHARS",
    "ClientKeys",
    "KeyPair",
    "check_private",
    "client_keys",
    "connect_keys",
    "create_keypair",
    "load_allowed",
    "load_keypair",
    "load_public",
]

#: Characters of a Z85 key (32 bytes).
KEY_CHARS = 40


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, Z85 text. ``repr`` never shows the secret."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public.decode()!r})"


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a connecting side (client, worker) needs: the server's public key, its own pair."""

    server: bytes
    own: KeyPair


def _is_z85_key(text: str) -> bool:
    if len(text) != KEY_CHARS:  # (Z85 has "/" and "." among its digits: not a path test)
        return False
    try:
        zmq.utils.z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        return False
    return True


def check_private(path: Path) -> None:
    """Refuse a secret key file its group or others may read or write.

    Raises:
        ConfigError: no such file, or its mode lets others in (the message names both).
    """
    mode = _mode(path, "secret key file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"secret key file {path} has mode {stat.S_IMODE(mode):04o}: its group or others "
            f"may read it; make it private (chmod 600 {path})"
        )


def load_keypair(source: str | os.PathLike[str], setting: str = "secret key") -> KeyPair:
    """This side's key pair, from its ``*.key_secret`` file (mode 0600).

    Args:
        source: the file's path.
        setting: the setting ``source`` came from, named in the errors.

    Raises:
        ConfigError: given as Z85 text rather than a file (the message names ``setting``
            and never shows the text), unreadable, not private, or holding no secret key.
    """
    text = os.fspath(source)
    if _is_z85_key(text) and not os.path.exists(text):
        raise ConfigError(
            f"{setting} must be the path of a .key_secret file (mode 0600), not the key "
            "itself: a key given as text shows in the process list and in unguarded files"
        )
    path = Path(text)
    check_private(path)
    public, secret = _certificate(path)
    if secret is None or len(secret) != KEY_CHARS:
        raise ConfigError(f"{path} holds no secret key (is it the public .key file?)")
    return KeyPair(public, secret)


def load_public(source: str | os.PathLike[str]) -> bytes:
    """A peer's public key: a ``*.key`` certificate file, or the Z85 key itself.

    Raises:
        ConfigError: unreadable or holding no public key.
    """
    text = os.fspath(source)
    if _is_z85_key(text) and not os.path.exists(text):
        return text.encode("ascii")
    public, _ = _certificate(Path(text))
    return public


def _certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE certificate {path}: {exc}") from None
    if not public or len(public) != KEY_CHARS:
        raise ConfigError(f"{path} holds no public key")
    return public, secret


def _mode(path: Path, what: str) -> int:
    """``path``'s mode bits; ConfigError naming ``what`` when it cannot be read."""
    try:
        return path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def _check_unwritable(path: Path) -> None:
    """Refuse an allow-list directory or key file its group or others may write."""
    mode = _mode(path, "the CURVE allow-list")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"CURVE allow-list {path} has mode {stat.S_IMODE(mode):04o}: its group or others "
            f"may write it and so add keys; make it theirs read-only (chmod go-w {path})"
        )


def load_allowed(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys of the ``*.key`` files in ``directory`` (an allow-list).

    Raises:
        ConfigError: the directory cannot be read, or a certificate in it cannot; the
            directory or one of its ``*.key`` files may be written by its group or others
            (the message names the path and its mode).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"CURVE allow-list {path} is not a directory")
    _check_unwritable(path)
    try:
        for key_file in sorted(path.glob("*.key")):
            _check_unwritable(key_file)
        keys = zmq.auth.load_certificates(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the CURVE allow-list {path}: {exc}") from None
    return frozenset(k for k in keys if len(k) == KEY_CHARS)


def create_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, mode 0644) and ``NAME.key_secret`` (mode 0600) in
    ``directory`` (made if missing, mode 0700); returns their paths.

    Raises:
        ConfigError: a file of that name exists already, or the directory cannot be written.
    """
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r}: a plain file name is needed")
    path = Path(directory)
    public, secret = path / f"{name}.key", path / f"{name}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise ConfigError(f"{p} exists already; remove it first or choose another name")
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = zmq.auth.create_certificates(path, name)
    except OSError as exc:
        raise ConfigError(f"cannot write keys in {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(made[1], 0o600)
    os.chmod(made[0], 0o644)
    return Path(made[0]), Path(made[1])


def connect_keys(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Set a connecting socket's CURVE options (before its ``connect``)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.own.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.own.secret)


def client_keys(server: str, own: str, own_setting: str = "curve_key") -> ClientKeys | None:
    """The keys of a connecting side from its settings (the broker's public key as a file
    path or Z85 text, its own pair as a ``.key_secret`` path); None when both are empty
    (CURVE off). ``own_setting`` names the second setting in the errors.

    Raises:
        ConfigError: only one of the two is given, or a key cannot be loaded.
    """
    if not server and not own:
        return None
    if not server or not own:
        raise ConfigError("CURVE needs both the broker's public key and this side's own key pair")
    return ClientKeys(load_public(server), load_keypair(own, own_setting))
