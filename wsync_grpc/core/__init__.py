"""The pure core of wsync: lifecycle, bucket layout, validation, dtypes, domain errors, the engine interface.

Nothing here imports gRPC, protobuf or ``torch.distributed``; the other layers build on it
(``docs/architecture.md``).
"""
