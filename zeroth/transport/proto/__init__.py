"""Generated gRPC stubs of ``protos/zeroth/v1/rendezvous.proto`` (do not edit; run ``python -m zeroth.protogen rendezvous``)."""
