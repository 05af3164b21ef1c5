"""The generated gRPC stubs under their old import path.

The stubs belong to the base layer and are generated into `base.v1` (`make proto`); this
package keeps `from pagedkv.v1 import engine_pb2` and `import pagedkv.v1.engine_pb2`
working for existing clients by registering the same module objects under both names (one
descriptor pool entry each, so messages from either path are the same classes).
"""

import sys

from base.v1 import engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc

for _module in (engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = ["engine_pb2", "engine_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
