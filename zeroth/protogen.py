"""Generate the checked-in gRPC stubs of ``protos/zeroth/v1/*.proto`` (one generator for every system).

Each system keeps its stubs inside its own package (``zeroth/net/proto/``, ``zeroth/pipeline/proto/``,
``zeroth/binary/proto/``) and has a two-line ``proto_gen`` module naming its proto files, stub folder
and package. The stubs are written by ``grpc_tools.protoc``; their cross-module imports are rewritten
from ``zeroth.v1`` (the proto path) to the package they live in. Each system's tests regenerate them
into a temporary folder and require byte equality with the checked-in files, so stubs never drift
from the contract.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
from collections.abc import Sequence

__all__ = ["PROTO_ROOT", "generate", "main"]

PROTO_ROOT = pathlib.Path(__file__).resolve().parents[1] / "protos"


def generate(proto_files: Sequence[str], dest: pathlib.Path, package: str) -> list[pathlib.Path]:
    """Run protoc on ``proto_files`` (paths under :data:`PROTO_ROOT`) and write ``<name>_pb2.py`` /
    ``<name>_pb2_grpc.py`` into ``dest``, imports of ``zeroth.v1`` rewritten to ``package``.

    Returns the written paths. Raises ``RuntimeError`` with protoc's exit code if it fails.
    """
    from grpc_tools import protoc  # dev dependency (grpcio-tools): only the stub tests and `proto_gen` need it

    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        for rel in proto_files:
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", rel]
            code = protoc.main(args)
            if code != 0:
                raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_ROOT / rel}")
            stem = pathlib.Path(rel).with_suffix("").name
            proto_package = ".".join(pathlib.Path(rel).parent.parts)  # zeroth.v1
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                src = pathlib.Path(tmp) / pathlib.Path(rel).parent / f"{stem}{suffix}"
                text = re.sub(rf"^from {re.escape(proto_package)} import ", f"from {package} import ",
                              src.read_text(), flags=re.M)
                out = dest / f"{stem}{suffix}"
                out.write_text(text)
                written.append(out)
    return written


def main(proto_files: Sequence[str], stub_dir: pathlib.Path, package: str) -> int:
    """Regenerate a system's stubs in place and print the written files."""
    for path in generate(proto_files, stub_dir, package):
        print(path)
    return 0
