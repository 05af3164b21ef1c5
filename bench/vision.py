"""Images on a small random Qwen3-VL (bench/vl_checkpoint.py; 2 vision blocks of width 32,
4 text layers of width 256), CPU worker, in one process (EngineCore: scheduler + worker, no
gRPC): what images cost and what the prefix cache saves. (At the tests' text width of 64 the
per-step fixed costs hide the prefix cache's saving: 1.9x measured, against 7.7x at 256.)

- encoder: per image size, the preprocessing (decode, resize, normalize, patchify) and the
  vision tower's forward, median ms per image.
- prefill: 8 requests of one 224 x 224 image + ~40 text tokens, max_tokens 1, together;
  prompt tokens (placeholders included) per second.
- prefix cache: 16 requests sharing one image + a ~700-token system prompt, each with its own
  question, one at a time (TTFT = the request's whole time, 1 output token). Cold: each with
  its own cache_salt (nothing hits); warm: after one priming request, every request hits the
  system prompt and the image (the encoder does not run); cold and warm alternate. Speed-up =
  median cold / median warm. The VL model runs the reference torch forward on the CPU, whose
  paged attention gathers the whole context every step, so a warm request still pays for
  attending over the cached prefix: expect a smaller ratio than the text suite's fused forward.

Run: `python -m bench.vision [--quick]`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from base.plan import SamplingParams
from bench.common import median
from bench.suite_cli import suite_main
from bench.vl_checkpoint import build_vl_checkpoint, make_image
from control_plane.engine import EngineCore
from control_plane.images import expand_images
from control_plane.scheduler_config import SchedulerConfig

SIZES = [(64, 64), (224, 224), (448, 448), (896, 672)]
MAX_PIXELS = 1024 * 1024  # the bench's processor lets large images stay large
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = "You are a meticulous visual assistant. Describe what you see, then answer the question. " * 8


def _encoder_ms(worker, sizes, reps: int) -> dict:
    import torch

    from worker.vision.preprocess import decode_rgb, preprocess

    mm = worker.model_config.multimodal
    out = {}
    for width, height in sizes:
        data = make_image(width, height, seed=width)
        prep, enc = [], []
        for _ in range(reps):
            started = time.perf_counter()
            image = preprocess(decode_rgb(data), mm.geometry, mm.normalization)
            prep.append(time.perf_counter() - started)
            patches = torch.from_numpy(image.patches)
            started = time.perf_counter()
            with torch.inference_mode():
                worker.model.encode_images(patches, [image.grid_thw])
            enc.append(time.perf_counter() - started)
        tokens = image.grid_thw[1] * image.grid_thw[2] // mm.geometry.merge_size**2
        out[f"image_{width}x{height}_tokens"] = tokens
        out[f"image_{width}x{height}_preprocess_ms"] = median(prep) * 1e3
        out[f"image_{width}x{height}_encoder_ms"] = median(enc) * 1e3
    return out


def _engine(worker) -> EngineCore:
    return EngineCore(worker, SchedulerConfig(max_num_batched_tokens=4096))


def _prefill_tok_s(worker, tokenizer, num_requests: int) -> dict:
    engine = _engine(worker)
    image = make_image(224, 224, seed=1)
    for i in range(num_requests):
        ids = tokenizer.encode(MARKER + f"Question {i}: what is shown in this picture, in detail?")
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True), images=[image])
    prompt_tokens = sum(len(r.prompt_token_ids) for r in engine.scheduler.requests.values())
    started = time.perf_counter()
    engine.run_to_completion()
    seconds = time.perf_counter() - started
    return {
        "requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "prefill_tok_s": prompt_tokens / seconds,
    }


def _one(engine: EngineCore, rid: str, ids: list[int], image: bytes, salt: str) -> float:
    started = time.perf_counter()
    engine.add_request(
        rid, ids, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt, images=[image]
    )
    engine.run_to_completion()
    return time.perf_counter() - started


def _prefix_ttft(worker, tokenizer, num_requests: int) -> dict:
    """Cold and warm requests alternate (a busy machine's drift hits both alike)."""
    engine = _engine(worker)
    image = make_image(448, 448, seed=2)
    prompts = [
        tokenizer.encode(SYSTEM + MARKER + f"Question {i}: what colour dominates?")
        for i in range(num_requests)
    ]
    _one(engine, "prime", prompts[0], image, "")
    cold, warm = [], []
    for i, ids in enumerate(prompts):
        cold.append(_one(engine, f"c{i}", ids, image, f"cold-{i}"))
        warm.append(_one(engine, f"w{i}", ids, image, ""))
    return {
        "prefix_requests": num_requests,
        "prefix_prompt_tokens": len(expand_images(prompts[0], [image], worker.describe())[0]),
        "ttft_cold_ms": median(cold) * 1e3,
        "ttft_warm_ms": median(warm) * 1e3,
        "prefix_ttft_speedup": median(cold) / median(warm),
    }


def run(quick: bool) -> dict:
    from worker import Worker, WorkerConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_vl_checkpoint(path, seed=0, max_pixels=MAX_PIXELS, text_layers=4, hidden_size=256)
        worker = Worker(WorkerConfig(model=str(path), num_blocks=4096, block_size=16))
        tokenizer = _tokenizer(path)
        return {  # flat: the report prints one row per figure
            **_encoder_ms(worker, SIZES[:2] if quick else SIZES, 3 if quick else 10),
            **_prefill_tok_s(worker, tokenizer, 4 if quick else 8),
            **_prefix_ttft(worker, tokenizer, 4 if quick else 16),
        }


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    class Encode:
        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

    return Encode()


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
