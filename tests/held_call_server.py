"""A peer server whose ``Join`` is held, as a leader holds one until it is decided (run as a script).

``python tests/held_call_server.py [PORT]`` prints its port (a free one unless given), then ``held``
each time a ``Join`` arrives; it
answers after as many seconds as the request's ``address`` field says, with a redirect to
``answered``. The server has the
peers' options (:data:`zeroth.net.transport.SERVER_OPTIONS`). A test freezes it with SIGSTOP.
"""

import time
from concurrent import futures

import grpc

from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.transport import SERVER_OPTIONS


class HeldJoin(pb_grpc.PeerServicer):
    def Join(self, request, context):
        print("held", flush=True)
        time.sleep(float(request.address))
        return pb.JoinResponse(redirect="answered")


if __name__ == "__main__":
    import sys

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=list(SERVER_OPTIONS))
    pb_grpc.add_PeerServicer_to_server(HeldJoin(), server)
    port = server.add_insecure_port(f"127.0.0.1:{sys.argv[1] if len(sys.argv) > 1 else 0}")
    server.start()
    print(port, flush=True)
    server.wait_for_termination(timeout=120)  # a bounded life even if the test that started it died
