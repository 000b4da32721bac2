"""trt_members.py: write the member lists of the real TensorRT Python binding modules.

    python tools/trt_members.py [--wheels DIR] [--out tests/data/tensorrt]

The API-surface test (tests/unit/worker/tensorrt/test_api_surface.py) checks every
tensorrt attribute the adapters use against these lists. They are read from the binding
modules themselves (``dir()`` of every class, and the return type in each pybind11
signature), not written by hand:

- the full bindings, ``tensorrt-cu12-bindings==10.3.0`` (JetPack 6's TensorRT) and
  ``tensorrt-cu13-bindings==11.4.0.106``: ``tensorrt.so`` links ``libnvinfer``,
  ``libnvonnxparser`` and ``libnvinfer_plugin``, which are not on the package index. The
  module only needs their factory symbols to *load* (nm lists ten), so this script
  generates a stub library defining each of them as a function returning NULL (with the
  C compiler ``cc``), names it by each soname, and imports the bindings against it;
- the lean 11.4 runtime, ``tensorrt-lean-cu13-libs`` + ``-bindings``, which import on a
  CPU as they are.

Each import runs in its own subprocess, which only lists names and reads docstrings: no
TensorRT object is created (a Runtime made without a GPU crashes the interpreter). The
wheels are fetched with ``pip download --no-deps`` into a temporary folder (never into
the repository) unless ``--wheels`` names a folder that holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (output file, module to import, wheels, sonames the module links that no wheel holds)
TARGETS = (
    (
        "tensorrt-10.3.0.json",
        "tensorrt_bindings",
        ("tensorrt-cu12-bindings==10.3.0",),
        ("libnvinfer.so.10", "libnvonnxparser.so.10", "libnvinfer_plugin.so.10"),
    ),
    (
        "tensorrt-11.4.0.106.json",
        "tensorrt_bindings",
        ("tensorrt-cu13-bindings==11.4.0.106",),
        ("libnvinfer.so.11", "libnvonnxparser.so.11", "libnvinfer_plugin.so.11"),
    ),
    (
        "tensorrt-lean-11.4.0.106.json",
        "tensorrt_lean_bindings",
        ("tensorrt-lean-cu13-bindings==11.4.0.106", "tensorrt-lean-cu13-libs==11.4.0.106"),
        (),
    ),
)

# Runs in the subprocess: prints {"version", "members": {class: {member: returns}},
# "callbacks": {class: [method]}}, where "<module>" holds the module's own names and
# `returns` is the class a call (or a property, or a value) gives, where that is one of
# the module's classes, else null.
_LIST = r"""
import importlib, inspect, json, re, sys
mod = importlib.import_module(sys.argv[1])
classes = {n for n, v in vars(mod).items() if inspect.isclass(v)}
SIG = re.compile(r"\)\s*->\s*([\w.]+)")
def returns(obj):
    if inspect.isclass(obj):
        return obj.__name__ if obj.__name__ in classes else None
    target = obj.fget if isinstance(obj, property) else obj
    doc = getattr(target, "__doc__", None) or ""
    if callable(target) or isinstance(obj, property):
        found = SIG.findall(doc.split("\n\n")[0] if "Overloaded" not in doc else doc)
        name = found[0].rsplit(".", 1)[-1] if found else None
        return name if name in classes else None
    name = type(obj).__name__
    return name if name in classes else None
def listing(names, get):
    out = {}
    for n in sorted(names):
        if n.startswith("__") and n not in ("__init__", "__version__"):
            continue
        try:
            out[n] = returns(get(n))
        except Exception:
            out[n] = None
    return out
members = {"<module>": listing(dir(mod), lambda n: getattr(mod, n))}
for c in sorted(classes):
    cls = getattr(mod, c)
    static = lambda n: inspect.getattr_static(cls, n, None) or getattr(cls, n)
    members[c] = listing(dir(cls), static)
# Methods an application class overrides (IOutputAllocator's reallocate_output_async, ...)
# are not attributes of a pybind11 trampoline class: its docstring's example names them.
DEF = re.compile(r"^\s*def (\w+)\(self", re.M)
callbacks = {}
for c in sorted(classes):
    names = sorted(set(DEF.findall(getattr(mod, c).__doc__ or "")) - {"__init__"})
    if names:
        callbacks[c] = names
version = getattr(mod, "__version__", None)
print(json.dumps({"version": version, "members": members, "callbacks": callbacks}))
"""


def _stub_library(folder: Path, sonames: tuple[str, ...], binding: Path) -> None:
    """One C file defining every symbol ``binding`` needs that libc/libstdc++/libpython do
    not give, as a function returning NULL, compiled once per soname."""
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(binding)], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    symbols = sorted(
        line.split()[-1]
        for line in undefined
        if line.strip().startswith("U ")
        and "@" not in line
        and not line.split()[-1].startswith(("Py", "_Py", "dl"))
    )
    source = folder / "stub.c"
    source.write_text("".join(f"void *{s}(void) {{ return 0; }}\n" for s in symbols))
    for soname in sonames:
        subprocess.run(
            [
                "cc",
                "-shared",
                "-fPIC",
                f"-Wl,-soname,{soname}",
                "-o",
                str(folder / soname),
                str(source),
            ],
            check=True,
        )


def _fetch(specs: tuple[str, ...], wheels: Path) -> list[Path]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            f"{sys.version_info.major}.{sys.version_info.minor}",
            "-d",
            str(wheels),
            *specs,
        ],
        check=True,
    )
    found = []
    for spec in specs:
        name, _, version = spec.partition("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        matches = sorted(wheels.glob(stem + "*.whl"))
        if not matches:
            raise SystemExit(f"no wheel {stem}*.whl in {wheels}")
        found.append(matches[0])
    return found


def members_of(
    module: str, specs: tuple[str, ...], sonames: tuple[str, ...], wheels: Path, work: Path
) -> dict[str, object]:
    site = work / "site"
    site.mkdir()
    for wheel in _fetch(specs, wheels):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), CUDA_VISIBLE_DEVICES="")
    if sonames:
        stubs = work / "stubs"
        stubs.mkdir()
        binding = next((site / module).glob("tensorrt*.so"))
        _stub_library(stubs, sonames, binding)
        env["LD_LIBRARY_PATH"] = str(stubs)
    # (the lean bindings need libnvinfer_lean, which importing its libs wheel loads)
    lean = module == "tensorrt_lean_bindings"
    code = ("import tensorrt_lean_libs\n" if lean else "") + _LIST
    done = subprocess.run(
        [sys.executable, "-c", code, module], env=env, capture_output=True, text=True, cwd=work
    )
    if done.returncode != 0:
        raise SystemExit(f"{module} from {specs} did not import:\n{done.stderr}")
    listing: dict[str, object] = json.loads(done.stdout)
    listing["wheels"] = list(specs)
    return listing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, help="a folder of the wheels (else a temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "tensorrt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trt-members-") as tmp:
        wheels = args.wheels or Path(tmp) / "wheels"
        for i, (filename, module, specs, sonames) in enumerate(TARGETS):
            work = Path(tmp) / str(i)
            work.mkdir()
            listing = members_of(module, specs, sonames, wheels, work)
            path = args.out / filename
            path.write_text(json.dumps(listing, indent=1, sort_keys=True) + "\n")
            classes = len(listing["members"]) - 1  # type: ignore[arg-type]
            print(f"{path}: {listing['version']}, {classes} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
