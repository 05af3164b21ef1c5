"""Turning each sampling sequence's last-position logits into tokens, batched on the logits'
device (CUDA or CPU: one code path, checked on the CPU against worker.reference_sampler).

Per row (one sequence that samples this step), in this order:
  - logit shaping (worker/logits_shaping.py: logit_bias, allowed_token_ids, min_tokens,
    penalties), only for rows that ask for any;
  - temperature 0: greedy, argmax of the shaped logits (lowest id on ties);
  - otherwise: logits / temperature, keep the top_k largest (0 = all), keep the smallest
    prefix of the remaining tokens, by descending probability, whose mass reaches top_p,
    drop tokens below min_p x the top probability, renormalize, draw by inverse CDF with one
    uniform number in [0, 1). Without truncation the CDF runs in vocabulary order (no sort).
`logprob` and the `top_logprobs` alternatives are always of log_softmax of the RAW logits: the
model's own probabilities, independent of temperature, shaping and truncation (vLLM's default
`raw_logprobs`; what clients compare across settings).

Reproducibility. A seeded request's uniform for the token at position p of sample i is a
64-bit hash of (seed, i, p) (`token_uniform`): stateless, so the same seed gives the same
tokens whatever else is in the batch, in whichever order, and after a preemption recomputes
the sequence. (The logits themselves must match, which they do up to floating-point effects
of batch shape.) Unseeded requests draw from the worker's own generator. A fan-out of n
samples from one row uses sample indices sample_index .. sample_index + n - 1, so child i
continues with the stream it started.

On the device: the uniforms (one float per drawn sample) are made on the host and copied
in; the vocabulary-wide work (scaling, top-k/sort, softmax, CDF, search, logprobs) runs
where the logits are, in float64; only the sampled ids and their logprobs come back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from base.plan import SamplingParams
from worker.grammar_mask import apply_bitmask
from worker.logits_shaping import shape_logits
from worker.token_counts import TokenCounts

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, sample_index: int, position: int) -> int:
    """Stable 63-bit seed for one drawn token (a positive torch seed on every platform)."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ sample_index) ^ position)
    return mixed >> 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one sampling sequence."""

    params: SamplingParams
    sample_index: int
    position: int  # position of the token being sampled = start_pos + len(token_ids)
    num_samples: int = 1
    num_candidates: int = 0  # beam search: the top this many of the log-softmax instead
    counts: TokenCounts | None = None  # penalized rows: the sequence's token counts
    num_generated: int = 0  # tokens generated before this one (min_tokens)
    grammar: object | None = None  # structured outputs: the sequence's matcher (its mask row)


@dataclass(frozen=True, slots=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[int] | None = None  # top_logprobs k per sampled token, flattened
    top_logprobs: list[float] | None = None


def token_uniform(seed: int, sample_index: int, position: int) -> float:
    """The uniform in [0, 1) of one seeded draw: 53 bits of a hash of its seed."""
    return (_splitmix64(token_seed(seed, sample_index, position)) >> 11) * 2.0**-53


def sample_uniforms(rows: Sequence[SamplingRow], generator: torch.Generator) -> list[list[float]]:
    """One uniform per drawn sample (none for greedy rows), on the host: seeded rows from
    their hash, the others from `generator`, in row order."""
    uniforms = []
    for row in rows:
        params = row.params
        if params.temperature <= 0:
            uniforms.append([])
        elif params.seed is not None:
            uniforms.append(
                [
                    token_uniform(params.seed, row.sample_index + k, row.position)
                    for k in range(row.num_samples)
                ]
            )
        else:
            draws = torch.rand(row.num_samples, generator=generator, dtype=torch.float64)
            uniforms.append(draws.tolist())
    return uniforms


# (rows [R, V] fp32 contiguous on the CPU, k) -> (logsumexp [R], top-k ids [R, k], their
# logprobs [R, k], largest first): the fast CPU forward's one-pass kernel (kernels/cpu_sampling.c).
LseTopk = Callable[[Tensor, int], tuple[Tensor, Tensor, Tensor]]
# rows [R, V] fp32 on the CPU, unit column stride -> torch.argmax(rows, dim=-1), the same ids
# (first of equal maxima, first NaN): the fast CPU forward's kernel (kernels/cpu_sampling.c).
RowArgmax = Callable[[Tensor], Tensor]


def picks_raw_argmax(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits and nothing else is read from
    them: greedy, no shaping, no logprobs, no beam, no grammar. A step of only such rows may
    take its tokens from a fused LM head + argmax (FastCpuForward.greedy_ids) that never writes
    the logits; `argmax_samples` gives what `Sampler.sample` would."""
    params = row.params
    return (
        params.temperature <= 0
        and not params.shapes_logits
        and not params.logprobs
        and not params.top_logprobs
        and not row.num_candidates
        and row.grammar is None
    )


def argmax_samples(ids: Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
    """Sampler.sample's result for rows that all pick their raw argmax (`picks_raw_argmax`):
    every sample of a row is its argmax id."""
    tokens = ids.tolist()
    return [SampledTokens([token] * row.num_samples, None) for token, row in zip(tokens, rows, strict=True)]


class Sampler:
    def __init__(
        self,
        seed: int,
        eos_token_ids: tuple[int, ...] = (),
        lse_topk: LseTopk | None = None,
        argmax: RowArgmax | None = None,
    ) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._eos = eos_token_ids  # min_tokens bans them too
        self._lse_topk = lse_topk  # logprobs of CPU logits without a materialized log-softmax
        # greedy rows: torch's CPU argmax ran at ~1 G logits/s, 11 ms of a batch-64 step over a
        # 152k vocabulary (docs/PERF.md)
        self._argmax = argmax

    def sample(
        self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: np.ndarray | None = None
    ) -> list[SampledTokens]:
        """logits: [len(rows), vocab], on any device. Returns one entry per row. `bitmask`:
        the packed allowed-token masks of the rows with a grammar, in row order
        (worker/grammar_mask.py); those rows sample only allowed tokens."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return []
        logits = logits.float()
        beams = [i for i, row in enumerate(rows) if row.num_candidates]
        if not beams:
            return self._sample(logits, rows, bitmask)
        others = [i for i, row in enumerate(rows) if not row.num_candidates]
        results: list[SampledTokens | None] = [None] * len(rows)

        # beams are never constrained (refused at admission): every bitmask row is in `others`
        def run_others(view, subset_rows):
            return self._sample(view, subset_rows, bitmask)

        for subset, run in ((beams, top_candidates), (others, run_others)):
            if subset:
                got = run(_rows_view(logits, subset), [rows[i] for i in subset])
                for i, item in zip(subset, got, strict=True):
                    results[i] = item
        return results

    def _logprobs(self, raw: Tensor, rows: Sequence[SamplingRow], owners: list[int], tokens: Tensor):
        """The sampled tokens' logprobs (rows asking `logprobs`, per sample in order) and each
        asking row's top_logprobs alternatives: row -> (ids, logprobs), best first. Both of the
        raw logits' log-softmax, computed once for the rows that want either."""
        tabled = [i for i, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs]
        if not tabled:
            return [], {}
        x = _rows_view(raw, tabled)
        slot = {row: j for j, row in enumerate(tabled)}
        k = max(rows[i].params.top_logprobs for i in tabled)
        picked = [s for s, i in enumerate(owners) if rows[i].params.logprobs]
        at = (_index([slot[owners[s]] for s in picked], raw), tokens[_index(picked, raw)])
        if self._lse_topk is not None and x.device.type == "cpu":
            lse, top_ids, top_values = self._lse_topk(x.contiguous(), k)
            logprobs = (x[at] - lse[at[0]]).tolist() if picked else []
        else:  # one materialized log-softmax (the device path and the oracle)
            table = torch.log_softmax(x, dim=-1)
            logprobs = table[at].tolist() if picked else []
            top_values, top_ids = torch.topk(table, k, dim=-1) if k else (None, None)
        if not k:
            return logprobs, {}
        top_ids, top_values = top_ids.tolist(), top_values.tolist()
        return logprobs, {
            i: (
                top_ids[slot[i]][: rows[i].params.top_logprobs],
                top_values[slot[i]][: rows[i].params.top_logprobs],
            )
            for i in tabled
            if rows[i].params.top_logprobs
        }

    def _greedy(self, logits: Tensor) -> Tensor:
        cpu = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
        if self._argmax is not None and cpu:
            return self._argmax(logits)
        return logits.argmax(dim=-1)

    def _sample(
        self, raw: Tensor, rows: Sequence[SamplingRow], bitmask: np.ndarray | None = None
    ) -> list[SampledTokens]:
        logits = shape_logits(raw, rows, self._eos)
        if bitmask is not None:
            constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
            shaped = [rows[i].params.shapes_logits for i in constrained]
            keep_raw = any(row.params.logprobs or row.params.top_logprobs for row in rows)
            logits = apply_bitmask(logits, raw, constrained, bitmask, shaped, keep_raw)
        uniforms = sample_uniforms(rows, self._generator)
        owners = [i for i, row in enumerate(rows) for _ in range(row.num_samples)]
        tokens = torch.empty(len(owners), dtype=torch.int64, device=logits.device)
        greedy = [i for i in range(len(rows)) if not uniforms[i]]
        if greedy:
            best = self._greedy(_rows_view(logits, greedy))
            slot = {row: j for j, row in enumerate(greedy)}
            samples = [s for s, i in enumerate(owners) if not uniforms[i]]
            tokens[_index(samples, logits)] = best[_index([slot[owners[s]] for s in samples], logits)]
        drawn = [s for s, i in enumerate(owners) if uniforms[i]]
        for chunk in _chunks(drawn, _draw_chunk_rows(logits)):
            flat = [uniforms[owners[s]][s - owners.index(owners[s])] for s in chunk]
            chosen = [owners[s] for s in chunk]
            tokens[_index(chunk, logits)] = _draw(_rows_view(logits, chosen), [rows[i] for i in chosen], flat)
        token_list = tokens.tolist()
        logprobs, tops = self._logprobs(raw, rows, owners, tokens)
        results, s, lp = [], 0, 0
        for i, row in enumerate(rows):
            end = s + row.num_samples
            row_logprobs = None
            if row.params.logprobs:
                row_logprobs, lp = logprobs[lp : lp + row.num_samples], lp + row.num_samples
            top_ids = top_values = None
            if i in tops:  # one distribution per row: a fan-out's samples share its alternatives
                top_ids, top_values = (x * row.num_samples for x in tops[i])
            results.append(SampledTokens(token_list[s:end], row_logprobs, top_ids, top_values))
            s = end
        return results


def top_candidates(logits: Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
    """Beam search: each row's `num_candidates` best tokens of the float32 log-softmax, best
    first (what Hugging Face's beam search ranks), computed where the logits are."""
    k = max(row.num_candidates for row in rows)
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        SampledTokens(ids[i][: row.num_candidates], values[i][: row.num_candidates])
        for i, row in enumerate(rows)
    ]


def _index(values: list[int], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=torch.int64).to(like.device, non_blocking=True)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[k : k + size] for k in range(0, len(items), size)]


def _draw_chunk_rows(logits: Tensor) -> int:
    """Rows drawn together. On the GPU the whole batch (fewer launches); on the CPU a few
    rows, so each pass over them stays in cache (one pass per op over a 32 x 152k batch
    streams 20 MB through memory five times)."""
    if logits.device.type != "cpu":
        return 1 << 30
    return max(1, CPU_DRAW_CHUNK_ELEMENTS // max(logits.shape[1], 1))


# Top-p without top-k: the nucleus is looked for among this many largest tokens first (a
# full-vocabulary sort costs ~250 ms at batch 32 x 152k on a 2-core CPU); only rows whose
# nucleus is larger fall back to the sort. Exact either way.
NUCLEUS_PROBE = 1024
NUCLEUS_MARGIN = 1e-3
# CPU draws run over row chunks of about this many logits (4 MB of float32: in cache;
# measured at batch 32 x 152k on the 2-core CI VM: 1 << 18 and 1 << 22 are both slower).
CPU_DRAW_CHUNK_ELEMENTS = 1 << 20


def _rows_view(t: Tensor, rows: list[int]) -> Tensor:
    """t[rows] without a copy when rows is every row in order (the common case)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, torch.tensor(rows, dtype=torch.int64).to(t.device))


def _draw(logits: Tensor, rows: Sequence[SamplingRow], uniforms: list[float]) -> Tensor:
    """Inverse-CDF draws, one per logit row (a drawn sample each, `rows[j]` its settings).
    Samples without truncation use the CDF in vocabulary order, the others the sorted
    (top-k / top-p) one. float32, as the reference."""
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32).to(device)
    u = torch.tensor(uniforms, dtype=torch.float32).to(device)
    scaled = _min_p(logits / temps[:, None], rows)
    truncated = [0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows]
    out = torch.empty(len(rows), dtype=torch.int64, device=device)
    plain = [j for j, t in enumerate(truncated) if not t]
    if plain:
        cdf = torch.cumsum(torch.softmax(_rows_view(scaled, plain), dim=-1), dim=-1)
        sel = torch.tensor(plain, dtype=torch.int64).to(device)
        pick = torch.searchsorted(cdf, (u[sel] * cdf[:, -1])[:, None], right=True)
        out[sel] = pick.squeeze(1).clamp_(max=vocab - 1)
    cut = [j for j, t in enumerate(truncated) if t]
    if cut:
        sel = torch.tensor(cut, dtype=torch.int64).to(device)
        out[sel] = _draw_truncated(_rows_view(scaled, cut), [rows[j].params for j in cut], u[sel])
    return out


def _min_p(scaled: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Tokens whose probability is below min_p x the most likely one's get -inf: in logit
    terms, below max + log(min_p). The ratio to the top token does not change with top-k or
    top-p truncation, so applying it before them equals Hugging Face's MinPLogitsWarper after."""
    if not any(r.params.min_p > 0 for r in rows):
        return scaled
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=scaled.dtype).to(scaled.device)
    floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log(0) = -inf: no-op
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _draw_truncated(scaled: Tensor, params: Sequence[SamplingParams], u: Tensor) -> Tensor:
    """Top-k then top-p, batched: candidates by descending probability, each row's tail past
    its own k masked, probabilities normalized over the row's candidates (its top k, or the
    whole vocabulary), the kept prefix by top_p, then the draw within it."""
    device, vocab = scaled.device, scaled.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    k = torch.tensor(ks, dtype=torch.int64).to(device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)[:, None]
    whole = torch.logsumexp(scaled, dim=-1, keepdim=True) if max(ks) == vocab else None
    kept, ids = _candidates(scaled, ks, whole, top_p)
    width = kept.shape[1]
    kept = kept.masked_fill(torch.arange(width, device=device)[None, :] >= k, float("-inf"))
    norm = torch.logsumexp(kept, dim=-1, keepdim=True)
    if whole is not None:  # rows without top-k are normalized over the whole vocabulary
        norm = torch.where(k >= vocab, whole, norm)
    probs = torch.exp(kept - norm)
    cdf = torch.cumsum(probs, dim=-1)
    k = k.clamp(max=width)
    # Keep token j while the mass strictly before it is below top_p (the first always);
    # top_p = 1 keeps all k (1 - a tiny last mass can round to 1.0).
    nucleus = torch.minimum(((cdf - probs) < top_p).sum(dim=-1, keepdim=True), k)
    num_kept = torch.where(top_p < 1.0, nucleus, k)
    total = cdf.gather(1, num_kept - 1)
    pick = torch.minimum(torch.searchsorted(cdf, u[:, None] * total, right=True), num_kept - 1)
    return ids.gather(1, pick).squeeze(1)


def _candidates(scaled: Tensor, ks: list[int], whole: Tensor | None, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """(values, ids) by descending value, wide enough for every row's candidate set: the
    largest k in the batch; with rows without top-k, the NUCLEUS_PROBE largest when every
    such row's nucleus lies within them (and every k fits), else a stable sort of all."""
    vocab = scaled.shape[1]
    if whole is None:
        return torch.topk(scaled, max(ks), dim=-1, sorted=True)
    probe = min(NUCLEUS_PROBE, vocab)
    values, ids = torch.topk(scaled, probe, dim=-1, sorted=True)
    mass = torch.exp(torch.logsumexp(values, dim=-1, keepdim=True) - whole)
    k = torch.tensor(ks, device=scaled.device)[:, None]
    # The margin keeps a nucleus that ends right at the probe's edge (rounding) out of it.
    fits = torch.where(k >= vocab, (mass >= top_p + NUCLEUS_MARGIN) & (top_p < 1.0), k <= probe)
    if bool(fits.all()):
        return values, ids
    return torch.sort(scaled, dim=-1, descending=True, stable=True)
