"""Tensor parallelism: one model served by N worker processes (ranks), invisible to the control
plane (docs/ARCHITECTURE.md "Tensor parallelism"). layout: who holds which slice; sharded_model:
loading and running one rank's slices; quant_shard: where a quantized layer's stored tensors
are cut per rank; group: torch.distributed between the ranks; rank: the
leader (rank 0, serves gRPC) and the followers."""
