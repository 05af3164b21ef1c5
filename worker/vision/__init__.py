"""Vision-language models (Qwen3-VL): image preprocessing, the vision tower, M-RoPE and the
per-sequence encoder cache. The language model itself is worker.model's decoder stack."""
