"""curvecmd.py: ``carpool keygen`` and the CURVE flags of ``carpool broker`` and ``worker``.

``carpool keygen DIR NAME`` writes ``DIR/NAME.key`` (the public key, to copy into a
peer's allow-list or hand to clients) and ``DIR/NAME.key_secret`` (mode 0600, stays on
its host). The flags overlay the ``[curve]`` table of a broker's file and the
``curve_*`` keys of a worker's (docs/security.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from carpool.commandline import add_command
from carpool.common.curve import create_keypair

__all__ = ["add_broker_flags", "add_parsers", "add_worker_flags", "broker_curve", "worker_curve"]


def _keygen(args: argparse.Namespace) -> int:
    """make a CURVE key pair

    Writes DIR/NAME.key (public: put a copy in the allow-list directory of the socket it
    may connect to, or give it to clients as the broker's key) and DIR/NAME.key_secret
    (mode 0600; keep it on the host that uses it). An existing pair is never replaced.
    """
    public, secret = create_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600)")
    return 0


def add_parsers(sub: Any) -> None:
    k = add_command(sub, "keygen", _keygen)
    k.add_argument("dir", help="directory to write the key files in (made if missing)")
    k.add_argument("name", help="file name of the pair: NAME.key and NAME.key_secret")


def add_broker_flags(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("CURVE", "encryption and key authentication ([curve] table)")
    c.add_argument("--curve", action="store_true", default=None, help="turn CURVE on")
    c.add_argument("--curve-server-key", metavar="FILE", help="the broker's .key_secret")
    c.add_argument("--curve-clients", metavar="DIR", help="allow-list of client keys")
    c.add_argument("--curve-workers", metavar="DIR", help="allow-list of worker keys")
    c.add_argument("--curve-operators", metavar="DIR", help="keys whose STATS are answered")


def broker_curve(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The broker's settings ``data`` with the CURVE flags over its ``[curve]`` table."""
    flags = {
        "enabled": args.curve,
        "server_key": args.curve_server_key,
        "clients": args.curve_clients,
        "workers": args.curve_workers,
        "operators": args.curve_operators,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    if not given:
        return data
    table = dict(data.get("curve", {}))
    table.update(given)
    return {**data, "curve": table}


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--curve-broker-key", metavar="FILE", help="the broker's public .key (CURVE)"
    )
    parser.add_argument("--curve-key", metavar="FILE", help="this worker's .key_secret (CURVE)")


def worker_curve(args: argparse.Namespace) -> dict[str, Any]:
    """The worker settings the CURVE flags give."""
    return {"curve_broker_key": args.curve_broker_key, "curve_key": args.curve_key}
