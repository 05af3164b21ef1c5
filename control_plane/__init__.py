"""The control plane: owns KV-cache memory (block pool, prefix cache, block tables, copy-on-write)
and scheduling; emits one Plan per step for the worker. Plain Python: never imports torch."""
