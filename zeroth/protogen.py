"""Generate the checked-in gRPC stubs of ``protos/zeroth/v1/*.proto``: one generator for every system.

Each system keeps its stubs inside its own package (:data:`STUBS`: ``zeroth/net/proto/``,
``zeroth/pipeline/proto/``, ``zeroth/binary/proto/``, ``zeroth/cluster/proto/``; the rendezvous of
``zeroth launch`` in ``zeroth/transport/proto/``). The stubs are written by
``grpc_tools.protoc``; their cross-module imports are rewritten from ``zeroth.v1`` (the proto path)
to the package they live in. Each system's tests regenerate them into a temporary folder and require
byte equality with the checked-in files, so stubs never drift from the contract.

Usage (from the repository root): ``python -m zeroth.protogen [net|pipeline|binary|cluster|rendezvous ...]`` (default: all).
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile
from typing import NamedTuple

__all__ = ["PROTO_ROOT", "StubSet", "STUBS", "stub_dir", "generate", "main"]

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = _PACKAGE_ROOT.parent / "protos"


class StubSet(NamedTuple):
    """The protos of one system and the package its stubs live in."""

    proto_files: tuple[str, ...]  # paths under PROTO_ROOT
    package: str  # e.g. "zeroth.net.proto"


STUBS = {
    "net": StubSet(("zeroth/v1/peer.proto",), "zeroth.net.proto"),
    "pipeline": StubSet(("zeroth/v1/pipeline.proto",), "zeroth.pipeline.proto"),
    "binary": StubSet(("zeroth/v1/binary.proto",), "zeroth.binary.proto"),
    "cluster": StubSet(("zeroth/v1/cluster.proto",), "zeroth.cluster.proto"),
    "rendezvous": StubSet(("zeroth/v1/rendezvous.proto",), "zeroth.transport.proto"),
}


def _stubs(system: str) -> StubSet:
    if system not in STUBS:
        raise ValueError(f"unknown system {system!r}; expected one of {sorted(STUBS)}")
    return STUBS[system]


def stub_dir(system: str) -> pathlib.Path:
    """The folder of ``system``'s checked-in stubs."""
    return _PACKAGE_ROOT.parent.joinpath(*_stubs(system).package.split("."))


def generate(system: str, dest: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on ``system``'s protos and write ``<name>_pb2.py`` / ``<name>_pb2_grpc.py`` into
    ``dest``, imports of ``zeroth.v1`` rewritten to the system's stub package.

    Returns the written paths. Raises ``RuntimeError`` with protoc's exit code if it fails.
    """
    from grpc_tools import protoc  # dev dependency (grpcio-tools): only the stub tests and this program need it

    stubs = _stubs(system)
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        for rel in stubs.proto_files:
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", rel]
            code = protoc.main(args)
            if code != 0:
                raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_ROOT / rel}")
            stem = pathlib.Path(rel).with_suffix("").name
            proto_package = ".".join(pathlib.Path(rel).parent.parts)  # zeroth.v1
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                src = pathlib.Path(tmp) / pathlib.Path(rel).parent / f"{stem}{suffix}"
                text = re.sub(
                    rf"^from {re.escape(proto_package)} import ",
                    f"from {stubs.package} import ",
                    src.read_text(),
                    flags=re.M,
                )
                out = dest / f"{stem}{suffix}"
                out.write_text(text)
                written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    """Regenerate the stubs of the named systems (all when none is named) in place; print the files."""
    systems = list(sys.argv[1:] if argv is None else argv) or sorted(STUBS)
    try:
        for system in systems:
            for path in generate(system, stub_dir(system)):
                print(path)
    except ValueError as exc:
        print(f"zeroth.protogen: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
