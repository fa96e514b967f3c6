"""Generated gRPC/protobuf code for proto/tokenwire/v1 (run `make proto`).

Everything else in this package is written by grpc_tools.protoc; never edit it by hand.
"""
