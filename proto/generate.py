"""Regenerate proto/v1's Python code from its .proto: `python proto/generate.py [--check]`.

The .proto is compiled as if it lived at gradq/proto/v1/, so the generated
imports name the installed package and need no rewriting.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "v1"
PACKAGE_PATH = Path("gradq/proto/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto in proto/v1 into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        source_root = Path(tmp) / "src"
        build_root = Path(tmp) / "build"
        (source_root / PACKAGE_PATH).mkdir(parents=True)
        build_root.mkdir()
        protos = sorted(PROTO_DIR.glob("*.proto"))
        for proto in protos:
            shutil.copy(proto, source_root / PACKAGE_PATH / proto.name)
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{source_root}",
            f"-I{include}",
            f"--python_out={build_root}",
            f"--pyi_out={build_root}",
            f"--grpc_python_out={build_root}",
            *(str(PACKAGE_PATH / p.name) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted((build_root / PACKAGE_PATH).iterdir()):
            if path.name.endswith(GENERATED_SUFFIXES):
                shutil.copy(path, out_dir / path.name)
                written.append(out_dir / path.name)
        return written


def drifted_files() -> list[str]:
    """Names of committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        fresh_names = {p.name for p in fresh}
        committed_names = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        drifted = sorted(committed_names ^ fresh_names)
        for path in fresh:
            committed = PROTO_DIR / path.name
            if committed.exists() and committed.read_bytes() != path.read_bytes():
                drifted.append(path.name)
        return drifted


def main() -> int:
    """Regenerate in place, or with --check report drift and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs from the .proto")
    if parser.parse_args().check:
        drifted = drifted_files()
        for name in drifted:
            print(f"proto/v1/{name} is out of date; run: python proto/generate.py", file=sys.stderr)
        return 1 if drifted else 0
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
