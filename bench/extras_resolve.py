"""extras_resolve.py: what carpool's GPU extras install on each target platform.

    python bench/extras_resolve.py [--out bench/out/extras_resolve.json]

For each target (JetPack 6 on Orin, x86_64 CUDA servers, aarch64 SBSA servers) and each
GPU extra (``gpu``, ``jetpack6``, ``cu12``, ``cu13``, ``trt``), the extra's requirements
are read from pyproject.toml, their environment markers evaluated for that target, and
``pip download --only-binary=:all: --python-version ... --platform ...`` resolves them
from the package index: the report lists the CUDA wheels it picked. It needs the package
index (it is not part of ``make test``; tests/unit/test_extras.py checks the markers
offline). It exits 1 when ``gpu`` or ``jetpack6`` on JetPack 6 resolves to a CUDA 13
binding (which needs driver 580: TensorRT would go unused there) or an extra resolves to
nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXTRAS = ("gpu", "jetpack6", "cu12", "cu13", "trt")
CUDA_PACKAGES = ("cuda-python", "cuda-bindings")


@dataclass(frozen=True)
class Target:
    name: str
    machine: str
    python: str
    glibc: tuple[int, int]  # the newest manylinux tag the platform takes

    def platforms(self) -> list[str]:
        """pip's --platform tags: manylinux2014 and each manylinux_2_X up to glibc's."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(17, minor + 1)]
        return [f"manylinux2014_{self.machine}", *tags]

    def environment(self) -> dict[str, str]:
        """PEP 508 marker variables of the target."""
        return {
            "platform_machine": self.machine,
            "python_version": self.python,
            "python_full_version": f"{self.python}.0",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
        }


TARGETS = (
    Target("jetpack6-orin", "aarch64", "3.10", (2, 35)),
    Target("x86-server-py3.10", "x86_64", "3.10", (2, 35)),
    Target("x86-server-py3.11", "x86_64", "3.11", (2, 35)),
    Target("x86-server-py3.12", "x86_64", "3.12", (2, 39)),
    Target("sbsa-server-py3.12", "aarch64", "3.12", (2, 39)),
)


def extras(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[str]]:
    """Each extra's requirements, an extra naming carpool's own extras expanded."""
    raw = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def expand(name: str) -> list[str]:
        out = []
        for line in raw[name]:
            req = Requirement(line)
            if req.name == "carpool":
                out += [r for extra in sorted(req.extras) for r in expand(extra)]
            else:
                out.append(line)
        return out

    return {name: expand(name) for name in raw}


def active(lines: list[str], target: Target) -> list[str]:
    """The requirements whose markers hold on ``target`` (markers dropped)."""
    env = target.environment()
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            out.append(str(req))
    return out


def resolve(requirements: list[str], target: Target) -> dict[str, object]:
    """The wheels pip picks for ``requirements`` on ``target`` (or its error)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"]
        command += ["--python-version", target.python, "--dest", folder]
        for tag in target.platforms():
            command += ["--platform", tag]
        done = subprocess.run(
            [*command, *requirements], capture_output=True, text=True, timeout=300, check=False
        )
        wheels = sorted(p.name for p in Path(folder).glob("*.whl"))
    if done.returncode:
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        return {"ok": False, "error": " ".join(errors)[-600:]}
    picked = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel)
        picked[str(name)] = str(version)
    return {"ok": True, "wheels": picked}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "extras_resolve.json")
    args = p.parse_args(argv)
    table = extras()
    report: dict[str, dict[str, object]] = {}
    bad = []
    for target in TARGETS:
        for extra in EXTRAS:
            reqs = active(table[extra], target)
            found = resolve(reqs, target)
            report[f"{target.name} [{extra}]"] = {"requirements": reqs, **found}
            wheels = found.get("wheels", {})
            assert isinstance(wheels, dict)
            cuda = {k: v for k, v in wheels.items() if k in CUDA_PACKAGES}
            shown = ", ".join(f"{k} {v}" for k, v in sorted(cuda.items())) or found.get("error")
            print(f"{target.name:20} {extra:9} {shown}")
            jetpack = target.name.startswith("jetpack6") and extra in ("gpu", "jetpack6", "trt")
            if not found["ok"] or (jetpack and any(v.split(".")[0] == "13" for v in cuda.values())):
                bad.append(f"{target.name} [{extra}]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {args.out}")
    if bad:
        print("not as documented:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
