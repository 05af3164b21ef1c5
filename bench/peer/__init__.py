"""`make bench-peer`: pagedkv beside vLLM's CPU engine and llama.cpp (see bench/peer/__main__.py)."""
