"""kernels/cpu_sampling.c's row_lse_topk (the sampler's logprobs on the fast CPU forward) against
torch's log_softmax + topk, and its row_argmax (greedy rows) against torch.argmax, in every ISA
variant this CPU runs; and the Sampler with the kernels against the Sampler without them (the
materialized log-softmax and torch's argmax, the oracle path)."""

from __future__ import annotations

import pytest
import torch

from base.plan import SamplingParams
from tests.cpu_kernels import load_ops
from worker.sampler import Sampler, SamplingRow


def lse_topk(ops, x: torch.Tensor, k: int, threads: int = 2):
    rows, n = x.shape
    lse, ids, vals = torch.empty(rows), torch.zeros(rows, k, dtype=torch.int64), torch.empty(rows, k)
    status = ops.row_lse_topk(x.data_ptr(), rows, n, x.stride(0), k, lse.data_ptr(), ids.data_ptr(),
                              vals.data_ptr(), threads)  # fmt: skip
    return status, lse, ids, vals


@pytest.mark.parametrize(
    "rows,vocab,k", [(1, 7, 3), (5, 1000, 20), (64, 32000, 20), (3, 33, 0), (2, 151936, 5)]
)
def test_logsumexp_and_top_k_equal_torch(ops, rows, vocab, k):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    x = torch.randn(rows, vocab + 3, generator=gen)[:, :vocab] * 4  # a row stride wider than the row
    status, lse, ids, vals = lse_topk(ops, x, k)
    assert status == 0
    table = torch.log_softmax(x, dim=-1)
    assert torch.allclose(lse, torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5)
    if k:
        want_vals, want_ids = torch.topk(table, k, dim=-1)
        assert torch.equal(ids, want_ids)  # random logits: no ties
        assert torch.allclose(vals, want_vals, atol=2e-5)


def test_ties_keep_the_lower_id_and_k_is_checked(ops):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    status, _, ids, _ = lse_topk(ops, x, 4)
    assert status == 0 and ids.tolist() == [[1, 2, 4, 3]]
    assert lse_topk(ops, x, 6)[0] == -2  # k > vocabulary
    assert lse_topk(ops, torch.randn(1, 100), 65)[0] == -2  # past the kernel's TOPK_MAX


def row_argmax(ops, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    out = torch.full((x.shape[0],), -1, dtype=torch.int64)
    ops.row_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), threads)
    return out


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (5, 17), (64, 32000), (2, 151936)])
def test_argmax_equals_torch(ops, rows, vocab):
    gen = torch.Generator().manual_seed(rows + vocab)
    x = torch.randn(rows, vocab + 5, generator=gen)[:, :vocab]  # a row stride wider than the row
    assert torch.equal(row_argmax(ops, x), x.argmax(dim=-1))


def test_argmax_ties_infinities_and_nan_follow_torch(ops):
    n = 40
    x = torch.zeros(7, n)
    x[0, [3, 17, 35]] = 5.0  # equal maxima in different 16-wide blocks: the first
    x[1] = float("-inf")  # every logit banned
    x[2, :] = float("-inf")
    x[2, 38] = -1.0  # the only allowed token, in the tail past the last full block
    x[3, [2, 30]] = float("nan")  # NaN wins, the first one
    x[3, 1] = float("inf")
    x[4, 33] = float("inf")
    x[5, 39] = float("nan")  # a NaN in the tail only
    x[6] = torch.arange(n, 0, -1).float()  # the max at 0
    got = row_argmax(ops, x)
    assert got.tolist() == x.argmax(dim=-1).tolist() == [3, 0, 38, 2, 33, 39, 0]


def test_sampler_with_the_kernel_equals_the_sampler_without():
    ops = load_ops()

    def kernel(x, k):
        status, lse, ids, vals = lse_topk(ops, x, k)
        assert status == 0
        return lse, ids, vals

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20),
        SamplingParams(temperature=0.7, seed=5, logprobs=True),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1, top_logprobs=3, n=2),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=0),
        SamplingParams(temperature=0.9, seed=2, logprobs=True, top_logprobs=1, n=3),
    ]
    rows = [SamplingRow(p, 0, 10, p.n) for p in params]
    plain = Sampler(0).sample(logits.clone(), rows)
    fast = Sampler(0, lse_topk=kernel, argmax=lambda x: row_argmax(ops, x)).sample(logits.clone(), rows)
    for a, b in zip(plain, fast, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None) and (a.top_ids is None) == (b.top_ids is None)
        if a.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=2e-5)
        if a.top_ids is not None:
            assert a.top_ids == b.top_ids
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=2e-5)
