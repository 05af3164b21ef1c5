"""`make bench-peer`: pagedkv side by side with vLLM's CPU engine (see bench/peer/__main__.py)."""
