"""Regenerate the checked-in gRPC stubs of ``protos/zeroth/v1/binary.proto`` into ``zeroth/binary/proto/``
with :mod:`zeroth.protogen` (the tests regenerate them and require byte equality).

Usage (from the repository root): ``python -m zeroth.binary.proto_gen``.
"""

from __future__ import annotations

import pathlib
import sys

from zeroth import protogen

__all__ = ["PROTO_ROOT", "PROTO_FILES", "STUB_DIR", "PACKAGE", "generate", "main"]

PROTO_ROOT = protogen.PROTO_ROOT
PROTO_FILES = ("zeroth/v1/binary.proto",)
STUB_DIR = pathlib.Path(__file__).resolve().parent / "proto"
PACKAGE = "zeroth.binary.proto"


def generate(dest: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on :data:`PROTO_FILES` and write the stubs into ``dest`` (see :func:`zeroth.protogen.generate`)."""
    return protogen.generate(PROTO_FILES, dest, PACKAGE)


def main(argv: list[str] | None = None) -> int:
    """Regenerate the stubs in place and print the written files."""
    del argv
    return protogen.main(PROTO_FILES, STUB_DIR, PACKAGE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
