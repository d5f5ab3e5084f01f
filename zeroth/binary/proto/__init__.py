"""Generated gRPC stubs of protos/zeroth/v1/binary.proto (regenerate with ``python -m zeroth.protogen binary``)."""
