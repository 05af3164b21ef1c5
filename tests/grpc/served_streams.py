"""Concurrent token-id streams against a served stack, each in its own thread (tests that
disturb the worker while the streams run: tests/grpc/test_serve_worker_crash.py,
tests/grpc/test_tensor_parallel_served.py)."""

from __future__ import annotations

import threading

from pagedkv.client import Client


class StreamThreads:
    """One greedy stream per prompt (ignore_eos, `max_tokens`), started at once; `tokens`
    fills as tokens arrive; a stream's failure is kept in `errors` for the test thread."""

    def __init__(
        self, address: str, prompts: list[list[int]], max_tokens: int, deadline_s: float, **kw
    ) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[BaseException] = []
        self.deadline_s = deadline_s
        self.threads = [
            threading.Thread(target=self._run, args=(address, i, p, max_tokens, kw), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, address: str, i: int, prompt: list[int], max_tokens: int, kw: dict) -> None:
        try:
            with Client(address, timeout=self.deadline_s) as client:
                for msg in client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **kw):
                    self.tokens[i].extend(msg.token_ids)
        except BaseException as e:  # reported by the test thread
            self.errors.append(e)

    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def join(self) -> list[list[int]]:
        """Every stream's tokens once all ended; fails on a hang past the deadline or an error."""
        for t in self.threads:
            t.join(self.deadline_s + 30)
        assert not any(t.is_alive() for t in self.threads), "a stream hung past its deadline"
        assert not self.errors, self.errors[:3]
        return self.tokens
