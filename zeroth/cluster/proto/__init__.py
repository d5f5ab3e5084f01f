"""Generated gRPC stubs of ``protos/zeroth/v1/cluster.proto`` (do not edit; run ``python -m zeroth.protogen cluster``)."""
