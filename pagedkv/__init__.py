"""pagedkv, the app layer: the CLI, `serve` and its supervisor, the client library, the offline
`LLM` and the OpenAI-compatible HTTP front. It imports the planes and `base`; nothing below
imports it. `pagedkv.v1` is an alias of the generated stubs in `base.v1`."""
