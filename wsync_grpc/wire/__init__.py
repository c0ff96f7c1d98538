"""The wire edge: ``wsync.v1`` messages <-> domain values, errors -> gRPC statuses, deadlines."""
