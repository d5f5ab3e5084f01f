"""Regenerate the checked-in gRPC stubs of ``protos/zeroth/v1/pipeline.proto`` into ``zeroth/pipeline/proto/``.

Same pattern as the peer protocol's stubs: generated with ``grpc_tools.protoc``, the one
cross-module import rewritten from ``zeroth.v1`` (the proto path) to ``zeroth.pipeline.proto``
(where they live in the package). ``tests/test_pipeline_wire.py`` regenerates them into a
temporary folder and requires byte equality with the checked-in files.

Usage (from the repository root): ``python -m zeroth.pipeline.proto_gen``.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

__all__ = ["PROTO_FILES", "PROTO_ROOT", "STUB_DIR", "generate", "main"]

_REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = _REPO / "protos"
PROTO_FILES = ("zeroth/v1/pipeline.proto",)
STUB_DIR = pathlib.Path(__file__).resolve().parent / "proto"


def generate(dest: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on :data:`PROTO_FILES` and write ``<name>_pb2.py`` / ``<name>_pb2_grpc.py`` into ``dest``.

    Returns the written paths. Raises ``RuntimeError`` with protoc's exit code if it fails.
    """
    from grpc_tools import protoc  # dev dependency (grpcio-tools)

    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        for rel in PROTO_FILES:
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", rel]
            code = protoc.main(args)
            if code != 0:
                raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_ROOT / rel}")
            stem = pathlib.Path(rel).with_suffix("").name
            package = ".".join(pathlib.Path(rel).parent.parts)  # zeroth.v1
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                src = pathlib.Path(tmp) / pathlib.Path(rel).parent / f"{stem}{suffix}"
                text = src.read_text()
                text = re.sub(rf"^from {re.escape(package)} import ", "from zeroth.pipeline.proto import ", text, flags=re.MULTILINE)
                out = dest / f"{stem}{suffix}"
                out.write_text(text)
                written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    """Regenerate the stubs in place and print the written files."""
    for path in generate(STUB_DIR):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
