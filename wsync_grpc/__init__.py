"""wsync: the weight-sync control plane (gRPC servicer, trainer client, reference engine)."""
