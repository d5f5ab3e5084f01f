"""Generated gRPC stubs of ``protos/zeroth/v1/peer.proto`` (do not edit; run ``python -m zeroth.protogen net``)."""
