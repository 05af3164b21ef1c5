"""The generated protocol code imports and round-trips a plan (make proto generated it)."""

from base.v1 import engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc


def test_worker_plan_round_trips():
    plan = worker_pb2.Plan(step_id=3, finished=[9])
    plan.new.add(seq_id=1, block_ids=[4, 5], token_ids=[1, 2, 3], start_pos=0, sample=True, num_samples=2)
    plan.continuing.add(seq_id=2, new_block_ids=[7], token_ids=[42], start_pos=31, sample=True)
    plan.continuing[0].replaced.add(index=1, block_id=8)
    plan.copies.add(src=6, dst=8)
    again = worker_pb2.Plan.FromString(plan.SerializeToString())
    assert again == plan and again.continuing[0].replaced[0].block_id == 8
    assert hasattr(worker_pb2_grpc, "WorkerStub")


def test_engine_request_carries_text_or_token_ids():
    # proto3 cannot put a repeated field in a oneof: "exactly one" is checked by the server
    # (tests/grpc/test_errors.py).
    req = engine_pb2.GenerateRequest.FromString(
        engine_pb2.GenerateRequest(token_ids=[1, 2]).SerializeToString()
    )
    assert list(req.token_ids) == [1, 2] and req.text == ""
    assert engine_pb2.FinishReason.Name(2) == "FINISH_REASON_LENGTH"
    assert hasattr(engine_pb2_grpc, "EngineStub")


def test_old_stub_import_path_is_the_same_modules():
    """`pagedkv.v1` (the path clients used before the stubs moved to the base layer) names the
    very modules in `base.v1`: one descriptor each, so messages from either path interoperate."""
    import pagedkv.v1.engine_pb2 as old_engine

    from pagedkv.v1 import worker_pb2 as old_worker

    assert old_engine is engine_pb2 and old_worker is worker_pb2
    assert isinstance(old_engine.ModelInfo(), engine_pb2.ModelInfo)
