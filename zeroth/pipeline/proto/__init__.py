"""Generated gRPC stubs of ``protos/zeroth/v1/pipeline.proto`` (do not edit; run ``python -m zeroth.protogen pipeline``)."""
