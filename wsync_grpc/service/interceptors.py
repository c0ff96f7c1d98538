"""The typing names of gRPC's server interceptors and method handlers, shared by every interceptor of the server.

grpcio's stubs make both generic (``grpc.ServerInterceptor[Req, Resp]``) for
type checking only; at run time the classes are not subscriptable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    Interceptor = grpc.ServerInterceptor[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]
else:
    Interceptor = grpc.ServerInterceptor
    Handler = grpc.RpcMethodHandler
