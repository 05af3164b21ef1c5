"""The floor both planes and the app stand on. Nothing in `base` imports anything of
pagedkv's outside `base` (tests/test_layering.py checks it).

    base.v1            generated protobuf/gRPC stubs of protos/pagedkv/v1 (`make proto`)
    base.plan          the step contract: Plan, StepResult, SamplingParams, ModelFacts
    base.plan_codec    those dataclasses <-> the Worker protocol's messages
    base.tokenizer     text <-> ids for the control plane (the worker ships its tokenizer)
    base.grpc_util     channel/server options, health and reflection, address parsing
    base.security      TLS and bearer tokens, server and client side
    base.service_registry  services registered with a deserializer that refuses malformed bytes
    base.logs          structlog set-up shared by every process
    base.metrics       Prometheus collectors of both processes
"""
