"""The checks a request passes before the scheduler queues it: its prompt, sampling and size
against the model and the KV pool, each failure an error that names what to change."""

from __future__ import annotations

from collections.abc import Collection

from base.plan import KVLayout, SamplingParams, WorkerInfo
from control_plane.beam_search import num_candidates
from control_plane.errors import InvalidRequestError, ResourceExhaustedError
from control_plane.kv_cache_manager import KVCacheManager
from control_plane.scheduler_config import SchedulerConfig


def check_request(
    prompt: Collection[int],
    sampling: SamplingParams,
    config: SchedulerConfig,
    info: WorkerInfo,
    max_model_len: int,
    max_running: int,
    kv: KVCacheManager,
) -> None:
    """Raises InvalidRequestError / ResourceExhaustedError when the request is wrong or can never
    run on this worker. O(1) checks first: a prompt longer than the model is refused before it is
    scanned (it may be a client's multi-megabyte token list; control_plane.limits)."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty; send at least one token")
    try:
        sampling.validate(config.max_n, info.vocab_size)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if len(prompt) + sampling.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"max length {max_model_len}; shorten the prompt or lower max_tokens"
        )
    vocab = info.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
    if sampling.n > max_running:
        raise InvalidRequestError(
            f"n={sampling.n} exceeds the {max_running} sequences that can run at once (max_num_seqs); lower n"
        )
    width = sampling.beam_width if sampling.is_beam_search else 1
    if (sampling.n > 1 or width > 1) and info.kv_layout != KVLayout.PAGED:
        what = "beam search" if width > 1 else "n > 1"
        raise InvalidRequestError(f"{what} needs shared KV blocks; the worker runs the contiguous layout")
    if width > 1:
        _check_beam_search(sampling, info, max_running)
    # A sliding window frees what it leaves behind: a sequence holds at most a chunk and a window.
    max_chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or max_model_len)
    need = width * kv.max_blocks_held(len(prompt) + sampling.max_tokens, max_chunk)
    if need > kv.pool.num_blocks - 1:
        beams = f" ({width} beams)" if width > 1 else ""
        raise ResourceExhaustedError(
            f"the request needs {need} KV blocks at full length{beams} but the pool has "
            f"{kv.pool.num_blocks - 1}; lower max_tokens or give the worker more KV memory"
        )


def _check_beam_search(sampling: SamplingParams, info: WorkerInfo, max_running: int) -> None:
    if sampling.beam_width > max_running:
        raise InvalidRequestError(
            f"beam_width={sampling.beam_width} exceeds the {max_running} sequences that can "
            f"run at once (max_num_seqs); lower beam_width"
        )
    stops = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stops.update(info.eos_token_ids)
    k = num_candidates(sampling.beam_width, len(stops))
    if k > info.vocab_size:
        raise InvalidRequestError(
            f"beam search needs {k} candidates per beam (beam_width x (1 + stop ids)) but the "
            f"vocabulary has {info.vocab_size} tokens; lower beam_width or send fewer stop_token_ids"
        )
