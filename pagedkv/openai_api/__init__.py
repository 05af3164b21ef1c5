"""The OpenAI-compatible HTTP front: a separate process that is a client of the gRPC Engine API.

    pagedkv openai --engine 127.0.0.1:50051 --port 8000      (or: pagedkv serve --http-port 8000)

Modules, one noun each: `protocol` (request bodies, validation, SamplingParams), `chat_template`
(transformers-compatible rendering), `generation` (the Engine streams of one request),
`responses` (OpenAI bodies and chunks), `logprobs` (token texts and bytes, logprob shapes),
`streaming` (SSE, client disconnects), `errors` (OpenAI error bodies, gRPC -> HTTP status),
`app`, `routes` (generation) and `extras` (tokenizer, model, version, metrics endpoints) (the
FastAPI application), `front_metrics` (/metrics: the front's requests, the Engine's gauges under
vLLM's names), `front` (what every route shares), `cli` (the `openai` command and serve's
hook). docs/OPENAI.md is the user's reference.

Importing this package (and `cli`) needs no FastAPI: `pagedkv --help` stays fast and the
gRPC-only install (no `http` extra) keeps working.
"""
