"""Builds the gRPC stubs of protos/generator.proto into `jaxrlhf_wire/_generated/` (git-ignored).

Run at install time (`make install` runs `python -m jaxrlhf_wire.build`), and again whenever the
.proto changes; importing `jaxrlhf_wire.stubs` only checks, with `check_stubs`, that the stubs
are there and were built from the .proto as it is now (a SHA-256 stamp beside them), and never
writes anything. Needs grpcio-tools. Imports nothing of the package that needs the stubs.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

PROTO_PATH = Path(__file__).resolve().parents[1] / "protos" / "generator.proto"
GENERATED_DIR = Path(__file__).resolve().parent / "_generated"
STAMP = "PROTO_SHA256"
STUB_FILES = ("__init__.py", "generator_pb2.py", "generator_pb2.pyi", "generator_pb2_grpc.py")
BUILD_COMMAND = "`make install` (or `python -m jaxrlhf_wire.build`)"


def _paths(generated_dir: Path | None, proto_path: Path | None) -> tuple[Path, Path]:
    """The given folder and .proto, or this package's (read at call time)."""
    return Path(generated_dir or GENERATED_DIR), Path(proto_path or PROTO_PATH)


def proto_digest(proto_path: Path) -> str:
    return hashlib.sha256(Path(proto_path).read_bytes()).hexdigest()


def stubs_problem(generated_dir: Path | None = None, proto_path: Path | None = None) -> str:
    """Why the stubs in `generated_dir` cannot be used with `proto_path` ("" if they can)."""
    generated_dir, proto_path = _paths(generated_dir, proto_path)
    missing = [name for name in STUB_FILES if not (generated_dir / name).exists()]
    if missing:
        return f"the gRPC stubs are missing from {generated_dir} ({', '.join(missing)})"
    if not proto_path.exists():
        return ""  # an installed copy without the .proto: the stubs shipped with it are used
    stamp = generated_dir / STAMP
    built_from = stamp.read_text().strip() if stamp.exists() else None
    if built_from != proto_digest(proto_path):
        return f"the gRPC stubs in {generated_dir} were built from another version of {proto_path}"
    return ""


def check_stubs(generated_dir: Path | None = None, proto_path: Path | None = None) -> None:
    """Raises ImportError, naming the command that builds them, unless the stubs are current."""
    problem = stubs_problem(generated_dir, proto_path)
    if problem:
        raise ImportError(f"{problem}; build them with {BUILD_COMMAND}")


def build_stubs(generated_dir: Path | None = None, proto_path: Path | None = None) -> None:
    """Runs protoc into a scratch folder, then moves the files in with atomic renames.

    Processes that import the stubs meanwhile (a running test or server) see every file whole:
    each is complete before `os.replace` puts it in place, and the stamp, which marks the set
    complete, goes last.
    """
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("building the gRPC stubs needs grpcio-tools") from error

    generated_dir, proto_path = _paths(generated_dir, proto_path)
    digest = proto_digest(proto_path)
    generated_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=generated_dir.parent, prefix=".protoc-") as scratch:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_path.parent}",
                f"-I{well_known}",
                f"--python_out={scratch}",
                f"--pyi_out={scratch}",
                f"--grpc_python_out={scratch}",
                str(proto_path),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed ({status}) on {proto_path}")
        grpc_module = Path(scratch) / "generator_pb2_grpc.py"
        # protoc writes a top-level `import generator_pb2`; inside a package it must be relative.
        grpc_module.write_text(
            grpc_module.read_text().replace(
                "import generator_pb2 as", "from . import generator_pb2 as"
            )
        )
        (Path(scratch) / "__init__.py").write_text("")
        (Path(scratch) / STAMP).write_text(digest + "\n")
        for name in STUB_FILES:
            os.replace(Path(scratch) / name, generated_dir / name)
        os.replace(Path(scratch) / STAMP, generated_dir / STAMP)


def main() -> int:
    build_stubs()
    print(f"built the gRPC stubs of {PROTO_PATH} in {GENERATED_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
