"""Which steps the CUDA decode graphs serve, decided on the CPU (issue 37): only pure decode rows
(one token past the prompt) may replay a graph. A 1-token prompt chunk, which the scheduler emits
when the step's token budget has one token left, goes through the eager forward, which computes
its prompt logprobs (and, for a vision model, its image rows and unshifted rotary positions).

The runner here is a real DecodeGraphRunner (its `accepts`, static buffers and persistent-table
gather) whose capture is replaced by running the same static-buffer forward eagerly: a CPU has
no CUDA graphs, and what is tested is the routing and the inputs a replay would read.

Also: served models never require grad (a capture outside inference mode would otherwise record
autograd and pin every graph's activations)."""

from __future__ import annotations

import torch
from torch import Tensor

from base.sampling import SamplingParams
from tests.worker.worker_test_utils import PlanDriver, make_worker
from worker.cuda_graph import DecodeGraphRunner, graph_key

PROMPT_LOGPROBS = SamplingParams(temperature=0.0, prompt_logprobs=2)


class HostTable:
    """The worker's persistent BlockTable as a CPU runner reads it: a CPU worker's table keeps
    no device copy (`sync()` is None there), so the gather reads the host array."""

    def __init__(self, table) -> None:
        self.table = table

    @property
    def host(self):
        return self.table.host

    def sync(self) -> Tensor:
        return torch.from_numpy(self.table.host)


class EagerStaticRunner(DecodeGraphRunner):
    """A DecodeGraphRunner that runs its static-buffer forward eagerly instead of replaying a
    captured graph, and records the steps it served as (seq id order, start positions)."""

    def __init__(self, worker) -> None:
        super().__init__(
            worker.model,
            worker.kv_cache,
            worker.max_model_len,
            4,
            worker.device,
            HostTable(worker.persistent_table),
        )
        self.served: list[list[int]] = []

    def forward(self, seqs) -> Tensor:
        assert self.accepts(seqs), "the worker routed a step the runner does not take"
        bucket, context = graph_key(seqs, self.buckets, self.context_buckets)
        self.static.fill(seqs, bucket, self.block_size, self.table)
        hidden = self._run(bucket, context)
        self.served.append([s.start_pos for s in seqs])
        return hidden[: len(seqs)]


def send_next_prompt_tokens(driver: PlanDriver) -> None:
    """Give each chunk that ends inside its prompt the token after it (NewSequence.next_token),
    as the control plane does for prompt logprobs; PlanDriver leaves it out."""
    execute = driver.worker.execute_with_logits

    def with_next_tokens(plan):
        for entry in [*plan.new, *plan.continuing]:
            seq = driver.seqs[entry.seq_id]
            end = entry.start_pos + len(entry.token_ids)
            if end < seq.prompt_len:
                entry.next_token = seq.tokens[end]
        return execute(plan)

    driver.worker.execute_with_logits = with_next_tokens


def scenario(worker) -> list:
    """Seq 2 prefills and decodes throughout; seq 1 (10-token prompt, prompt logprobs) prefills
    8 tokens, then one (position 8: a 1-token chunk whose row gives token 9's prompt logprob),
    then its last prompt token alone (position 9), then decodes."""
    driver = PlanDriver(worker)
    send_next_prompt_tokens(driver)
    driver.add(1, list(range(20, 30)), prompt_len=10, sampling=PROMPT_LOGPROBS)
    driver.add(2, [5, 6, 7], prompt_len=3)
    results = [driver.step({2: None})] + [driver.step({1: n, 2: None}) for n in (8, 1, 1)]
    return results + [driver.step({1: None, 2: None}) for _ in range(3)]


def test_a_one_token_prompt_chunk_runs_eager_and_keeps_its_prompt_logprobs(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    graphed = make_worker(path, 4, cpu_kernels="reference")
    runner = graphed.decode_graphs = EagerStaticRunner(graphed)
    got = scenario(graphed)
    want = scenario(make_worker(path, 4, cpu_kernels="reference"))
    # Steps 3 and 4 have one token per row but carry seq 1's prompt tokens 8 and 9: eager.
    # Only the last three steps are pure decode (seq 1 at 10.., seq 2 at 6..).
    assert runner.served == [[10, 6], [11, 7], [12, 8]]
    assert [p.seq_id for p in got[2].prompt_logprobs] == [1], "the 1-token chunk's prompt logprob"
    for mine, theirs in zip(got, want, strict=True):
        assert mine.outputs == theirs.outputs
        assert mine.prompt_logprobs == theirs.prompt_logprobs


def test_a_decode_row_is_one_token_past_the_prompt(checkpoint):
    """ScheduledSequence.decode as the worker sets it from the plan (worker/step_work.py)."""
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, 4, cpu_kernels="reference")
    runner = worker.decode_graphs = EagerStaticRunner(worker)
    driver = PlanDriver(worker)
    driver.add(1, [3, 4, 5], prompt_len=3)
    driver.step({1: 2})
    driver.step({1: 1})  # the prompt's last token: one token, not a decode
    assert runner.served == []
    driver.step({1: None})
    assert runner.served == [[3]]


def test_loaded_models_do_not_require_grad(checkpoint):
    for name in ("qwen3-head-dim-tied", "llama-gqa-derived-head-dim"):
        _, path = checkpoint(name)
        model = make_worker(path, 4, cpu_kernels="reference").model
        grads = [name for name, p in model.named_parameters() if p.requires_grad]
        assert model.training is False and grads == [], f"parameters that require grad: {grads[:5]}"
