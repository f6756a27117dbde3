"""gRPC contract of the generator service (protos/generator.proto) and a small client for it.

The Python stubs are not committed: they are generated here, on first import, with
grpc_tools.protoc from the .proto into `_generated/` (git-ignored), and regenerated whenever the
.proto's content changes. That keeps one source of truth and avoids stubs that drift from it.
This package must stay light: the learner imports it, so no vLLM, no JAX, no torch.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType

PROTO_PATH = Path(__file__).resolve().parents[2] / "protos" / "generator.proto"
GENERATED_DIR = Path(__file__).resolve().parent / "_generated"
_STAMP = "PROTO_SHA256"


def _proto_digest() -> str:
    return hashlib.sha256(PROTO_PATH.read_bytes()).hexdigest()


def _stubs_current(digest: str) -> bool:
    stamp = GENERATED_DIR / _STAMP
    return (
        stamp.exists()
        and stamp.read_text().strip() == digest
        and (GENERATED_DIR / "generator_pb2.py").exists()
        and (GENERATED_DIR / "generator_pb2_grpc.py").exists()
    )


def _generate_stubs(digest: str) -> None:
    """Runs protoc into a scratch folder, then moves the files in with atomic renames.

    Several processes (a test run and the server it starts) may import this at once; each writes
    complete files and `os.replace` makes every file appear whole, so no reader sees a half file.
    """
    try:
        from grpc_tools import protoc
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "jaxrlhf.rpc needs generated gRPC stubs and grpcio-tools to build them: "
            "pip install grpcio-tools"
        ) from error
    import grpc_tools

    GENERATED_DIR.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=GENERATED_DIR.parent, prefix=".protoc-") as scratch:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_PATH.parent}",
                f"-I{well_known}",
                f"--python_out={scratch}",
                f"--pyi_out={scratch}",
                f"--grpc_python_out={scratch}",
                str(PROTO_PATH),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed ({status}) on {PROTO_PATH}")
        grpc_module = Path(scratch) / "generator_pb2_grpc.py"
        # protoc writes a top-level `import generator_pb2`; inside a package it must be relative.
        grpc_module.write_text(
            grpc_module.read_text().replace(
                "import generator_pb2 as", "from . import generator_pb2 as"
            )
        )
        (Path(scratch) / "__init__.py").write_text("")
        (Path(scratch) / _STAMP).write_text(digest + "\n")
        # The stamp goes last: it is what marks the set complete.
        for name in [
            "__init__.py",
            "generator_pb2.py",
            "generator_pb2.pyi",
            "generator_pb2_grpc.py",
        ]:
            os.replace(Path(scratch) / name, GENERATED_DIR / name)
        os.replace(Path(scratch) / _STAMP, GENERATED_DIR / _STAMP)


def _load_stubs() -> tuple[ModuleType, ModuleType]:
    # Without the .proto (an installed copy of the package) the stubs shipped beside it are used.
    if PROTO_PATH.exists():
        digest = _proto_digest()
        if not _stubs_current(digest):
            _generate_stubs(digest)
    pb2 = importlib.import_module(f"{__name__}._generated.generator_pb2")
    pb2_grpc = importlib.import_module(f"{__name__}._generated.generator_pb2_grpc")
    return pb2, pb2_grpc


generator_pb2, generator_pb2_grpc = _load_stubs()

SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name

from jaxrlhf.rpc.client import (  # noqa: E402  (needs the stubs above)
    GeneratorClient,
    auth_metadata,
    encode_weight_chunks,
    iter_weight_chunks,
)

__all__ = [
    "PROTO_PATH",
    "SERVICE_NAME",
    "GeneratorClient",
    "auth_metadata",
    "encode_weight_chunks",
    "generator_pb2",
    "generator_pb2_grpc",
    "iter_weight_chunks",
]
