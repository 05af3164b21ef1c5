"""Multi-LoRA serving in the worker: PEFT adapter checkpoints (adapter.py), the resident set
with LRU eviction (registry.py), and the per-row deltas of a step (batch.py) that the
reference forward applies in torch and the fast CPU forward in C (kernels/cpu_lora.c)."""
