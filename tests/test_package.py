"""The package root: ``zeroth.__all__`` names every public module, each imports and says what it is."""

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import zeroth

ROOT = Path(zeroth.__file__).parent


def test_every_name_in_all_is_a_documented_module():
    for name in zeroth.__all__:
        module = importlib.import_module(f"zeroth.{name}")
        assert module.__doc__ and module.__doc__.strip(), f"zeroth.{name} has no docstring"
    assert len(set(zeroth.__all__)) == len(zeroth.__all__)


def test_all_lists_every_module_of_the_root():
    found = {m.name for m in pkgutil.iter_modules([str(ROOT)])} - {"__main__"}
    assert set(zeroth.__all__) == found, (found - set(zeroth.__all__), set(zeroth.__all__) - found)


def test_import_zeroth_imports_nothing_and_star_import_imports_the_modules():
    code = (
        "import sys, zeroth; before = {m for m in sys.modules if m.startswith('zeroth.')}; "
        "assert not before and 'jax' not in sys.modules, before; "
        "from zeroth import *; "
        "missing = [n for n in zeroth.__all__ if f'zeroth.{n}' not in sys.modules]; assert not missing, missing; "
        "print(len(zeroth.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(len(zeroth.__all__))


# A server that stops with calls in flight sends GOAWAY ("Cancelling all calls"); gRPC's C core
# logs the client's side of it at INFO, on stderr.
_GOAWAY = """
import os, sys, time
from concurrent import futures
if sys.argv[1] == "zeroth":
    import zeroth
import grpc

def slow(request, context):
    time.sleep(2)
    return request

server = grpc.server(futures.ThreadPoolExecutor(4))
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"E": grpc.unary_unary_rpc_method_handler(slow)})])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/t.T/E")
pending = [call.future(b"x") for _ in range(3)]
time.sleep(0.3)
server.stop(None)
codes = []
for f in pending:
    try:
        f.result(timeout=10)
        codes.append("OK")
    except grpc.RpcError as e:
        codes.append(e.code().name)
time.sleep(0.3)
print(",".join(codes), os.environ.get("GRPC_VERBOSITY"))
"""


def _goaway(first: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    return subprocess.run(
        [sys.executable, "-c", _GOAWAY, first], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_importing_zeroth_keeps_grpc_transport_chatter_off_stderr_unless_the_user_asks_for_it():
    quiet = _goaway("zeroth")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.split() == ["UNAVAILABLE,UNAVAILABLE,UNAVAILABLE", "ERROR"]
    assert quiet.stderr.strip() == "", quiet.stderr[-2000:]  # without zeroth: "I... Got goaway [2] ..." (on most runs)
    asked = _goaway("zeroth", GRPC_VERBOSITY="INFO")  # the user's own level is kept, and gRPC takes it
    assert asked.stdout.split() == ["UNAVAILABLE,UNAVAILABLE,UNAVAILABLE", "INFO"]
    assert "Log level INFO is not suitable for production" in asked.stderr, asked.stderr[-2000:]


def test_the_suites_longest_first_order_names_its_own_files_and_leads_the_collection(request):
    """tests/conftest.py hands the files out longest first: each name in LONGEST_FIRST is a test
    file here, named once, and the collected tests start with them in that order."""
    import conftest

    here = Path(__file__).parent
    names = conftest.LONGEST_FIRST
    assert len(set(names)) == len(names)
    assert [n for n in names if not (here / n).is_file()] == []
    files = list(dict.fromkeys(item.path.name for item in request.session.items))
    if set(names) <= set(files):  # the whole suite was collected (not a selection of it)
        assert files[: len(names)] == list(names)
