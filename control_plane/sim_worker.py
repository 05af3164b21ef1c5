"""A torch-free stand-in for the worker that *checks* paging instead of running a model.

Its "KV cache" stores, for each slot, the token id written there. Every step it applies the
plan exactly as the real worker must (drop finished, register/extend tables, copy-on-write
copies, write new tokens by slot), then reads each scheduled sequence's whole context back
*through its block table* and derives the next token from what it read:

    next token = sim_next_token(context read back from the paged KV, sample index)
    beam candidates = sim_candidates(that context, how many)

`window` > 0 stands for a model windowed in every layer: the next token depends on the last
`window` tokens only, read back through the table, whose earlier entries the control plane
releases (ContinuingSequence.num_released_blocks; a release the window still reads is refused).

So a wrong table entry, a missing copy, a stale prefix-cache hit or a block reused while still
referenced changes the tokens, and tests comparing against `reference_tokens` (computed
without any paging) catch it.

LoRA adapters: `load_adapter` registers an id (name@hash of the path); a sequence's slots hold
its tokens tagged with its adapter (`adapter_tag`), as real KV holds values only that adapter
computes. A block of one adapter read by a request on another (a prefix-cache hit across
adapters) therefore changes its tokens, and a plan naming an unregistered id is refused.
`verify=False` skips the read-back (transport benchmarks).
"""

from __future__ import annotations

import time
from array import array
from hashlib import blake2b

from base.plan import NULL_BLOCK_ID, AdapterInfo, Plan, SeqOutput, StepResult, WorkerInfo
from control_plane.beam_search import Beam


def adapter_tag(adapter_id: str) -> int:
    """What a slot adds to the token an adapter's sequence wrote there (0 for the base model).
    Tags sit above bit 20: vocabularies stay below 2^20."""
    if not adapter_id:
        return 0
    return (int.from_bytes(blake2b(adapter_id.encode(), digest_size=4).digest(), "little") % 1023 + 1) << 20


def sim_adapter_id(name: str, path: str) -> str:
    return f"{name}@{blake2b(path.encode(), digest_size=8).hexdigest()}"


def sim_next_token(context: list[int], sample_index: int, vocab_size: int) -> int:
    h = blake2b(array("I", context).tobytes(), digest_size=8, salt=sample_index.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") % vocab_size


def sim_candidates(context: list[int], k: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """Beam search's top-k stand-in: k distinct tokens with strictly decreasing logprobs, all
    derived from the context (rank r's logprob lies in (-(r + 1), -r])."""
    tokens: list[int] = []
    logprobs: list[float] = []
    salt = 1 << 20
    while len(tokens) < k:
        token = sim_next_token(context, salt, vocab_size)
        salt += 1
        if token not in tokens:
            frac = sim_next_token(context, salt, 1 << 16) / (1 << 16)
            logprobs.append(-(len(tokens) + frac))
            tokens.append(token)
    return tokens, logprobs


def reference_beams(prompt: list[int], search, vocab_size: int, window: int = 0):
    """What a correct engine returns for a beam search (`control_plane.beam_search.BeamSearch`,
    fresh), with no paging involved: its finished hypotheses, best first."""
    beams = [Beam([], [])]
    while True:
        contexts = [(prompt + b.token_ids)[-window:] if window else prompt + b.token_ids for b in beams]
        candidates = [
            list(zip(*sim_candidates(context, search.num_candidates, vocab_size), strict=True))
            for context in contexts
        ]
        chosen = search.step(beams, candidates)
        if search.done:
            return search.finished
        beams = [
            Beam(
                [*beams[c.parent].token_ids, c.token],
                [*beams[c.parent].logprobs, c.logprob],
                c.cumulative_logprob,
            )
            for c in chosen
        ]


def reference_tokens(
    prompt: list[int],
    sample_index: int,
    max_tokens: int,
    vocab_size: int,
    stop_ids: frozenset[int] = frozenset(),
    window: int = 0,
    adapter_id: str = "",
) -> list[int]:
    """What a correct engine must produce for one sample, with no paging involved."""
    tag = adapter_tag(adapter_id)
    seq = [t | tag for t in prompt]
    out = []
    for _ in range(max_tokens):
        t = sim_next_token(seq[-window:] if window else seq, sample_index, vocab_size)
        out.append(t)
        seq.append(t | tag)
        if t in stop_ids:
            break
    return out


class SimWorker:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 16,
        vocab_size: int = 1000,
        max_model_len: int = 4096,
        eos_token_ids: tuple[int, ...] = (),
        verify: bool = True,
        window: int = 0,
        max_loras: int = 4,
    ) -> None:
        self.block_size = block_size
        self.verify = verify
        self.window = window
        self._info = WorkerInfo(
            model_name="sim",
            architecture="SimWorker",
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            dtype="int32",
            block_size=block_size,
            num_blocks=num_blocks,
            bytes_per_block=4 * block_size,
            device="sim",
            instance_id=f"sim-{time.monotonic_ns()}",
            eos_token_ids=eos_token_ids,
            sliding_window=window,
            draft_model="sim-draft",  # ContinuingSequence.num_draft_tokens: see _draft
            max_loras=max_loras,
            max_lora_rank=64,
        )
        self.registered: dict[str, AdapterInfo] = {}  # LoRA adapter id -> info
        self.seq_adapters: dict[int, str] = {}  # seq id -> its adapter id ("" = the base model)
        self.slots = array("i", [-1]) * (num_blocks * block_size)
        self.tables: dict[int, list[int]] = {}
        self.sample_index: dict[int, int] = {}
        self.last_sample: dict[int, int] = {}  # what ContinuingSequence.feed_last_sample reads
        self.num_copies = 0

    def describe(self) -> WorkerInfo:
        return self._info

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        adapter_id = sim_adapter_id(name, path)
        info = AdapterInfo(name, adapter_id, path, 8, adapter_id.partition("@")[2])
        self.registered.setdefault(adapter_id, info)
        return info

    def unload_adapter(self, adapter_id: str) -> None:
        if self.registered.pop(adapter_id, None) is None:
            raise ValueError(f"adapter {adapter_id!r} is not registered")

    def adapters(self) -> list[AdapterInfo]:
        return list(self.registered.values())

    def reset(self) -> None:
        self.seq_adapters.clear()
        self.tables.clear()
        self.sample_index.clear()
        self.last_sample.clear()

    def execute(self, plan: Plan) -> StepResult:
        for seq_id in plan.finished:
            if self.tables.pop(seq_id, None) is None:
                raise ValueError(f"finished sequence {seq_id} is not mirrored")
            self.sample_index.pop(seq_id, None)
            self.last_sample.pop(seq_id, None)
            self.seq_adapters.pop(seq_id, None)
        for s in plan.new:
            if s.seq_id in self.tables:
                raise ValueError(f"new sequence {s.seq_id} already mirrored")
            if s.adapter and s.adapter not in self.registered:
                raise ValueError(f"new sequence {s.seq_id} names adapter {s.adapter!r}, not registered")
            self.seq_adapters[s.seq_id] = s.adapter
            self.tables[s.seq_id] = list(s.block_ids)
            self.sample_index[s.seq_id] = s.sample_index
        for s in plan.continuing:
            table = self.tables[s.seq_id]
            released = s.num_released_blocks
            if released and released * self.block_size > s.start_pos - self.window + 1:
                raise ValueError(f"sequence {s.seq_id} releases block {released - 1}, which its window reads")
            table[:released] = [NULL_BLOCK_ID] * released
            for index, block_id in s.replaced:
                table[index] = block_id
            table.extend(s.new_block_ids)
        bs = self.block_size
        destinations = [dst for _, dst in plan.copies]
        if len(set(destinations)) != len(destinations) or any(s == d for s, d in plan.copies):
            raise ValueError(f"copies {plan.copies} write a block twice or onto itself")
        for src, dst in plan.copies:  # in list order, as the worker does
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
            self.num_copies += 1
        started = time.perf_counter()
        outputs = []
        items = [(s, self._inputs(s)) for s in (*plan.new, *plan.continuing)]
        for s, token_ids in items:
            self._write(s.seq_id, s.start_pos, token_ids)
        for s, token_ids in items:
            if not s.sample:
                continue
            context = self._read(s.seq_id, s.start_pos + len(token_ids)) if self.verify else token_ids
            base = self.sample_index[s.seq_id]
            vocab = self._info.vocab_size
            if s.num_candidates:
                toks, logprobs = sim_candidates(context, s.num_candidates, vocab)
                outputs.append(SeqOutput(s.seq_id, toks, logprobs))
                continue
            if s.num_speculative_tokens or s.num_draft_tokens:
                toks = self._verify(s, token_ids, base)
                self.last_sample[s.seq_id] = toks[-1]
                outputs.append(SeqOutput(s.seq_id, toks, None))
                continue
            toks = [sim_next_token(context, base + i, vocab) for i in range(s.num_samples)]
            self.last_sample[s.seq_id] = toks[0]
            outputs.append(SeqOutput(s.seq_id, toks, None))
        # Like the real worker: the "forward" is timed only when something was scheduled.
        elapsed = time.perf_counter() - started if items else 0.0
        return StepResult(plan.step_id, outputs, forward_seconds=elapsed)

    def _verify(self, s, token_ids: list[int], sample_index: int) -> list[int]:
        """A speculative verify, greedy (base/plan.py): the next token after each input, read
        back through the table; proposals kept while they agree, the rest rolled back."""
        proposals = token_ids[1:]
        vocab = self._info.vocab_size
        toks = []
        for i in range(len(proposals) + 1):
            context = self._read(s.seq_id, s.start_pos + 1 + i) if self.verify else token_ids[: 1 + i]
            toks.append(sim_next_token(context, sample_index, vocab))
            if i == len(proposals) or toks[i] != proposals[i]:
                break
        keep = -(-(s.start_pos + len(toks)) // self.block_size)
        del self.tables[s.seq_id][keep:]
        return toks

    def _inputs(self, s) -> list[int]:
        """The step's input tokens; a fed sample is consumed, as every step consumes the last one."""
        last = self.last_sample.pop(s.seq_id, None)
        if s.feed_last_sample:
            if last is None:
                raise ValueError(f"sequence {s.seq_id} feeds a last sample it does not have")
            return [last]
        if s.num_draft_tokens:
            return self._draft(s)
        return s.token_ids

    def _draft(self, s) -> list[int]:
        """A draft model's stand-in (ContinuingSequence.num_draft_tokens): the input and k
        proposals, each the true next token except where a hash of its context says it errs
        (about one in three), so verifies accept some proposals and reject others."""
        context = (self._read(s.seq_id, s.start_pos) if self.verify else []) + list(s.token_ids)
        out = list(s.token_ids)
        vocab = self._info.vocab_size
        for _ in range(s.num_draft_tokens):
            token = sim_next_token(context, self.sample_index[s.seq_id], vocab)
            if sim_next_token(context, 1 << 30, 3) == 0:
                token = (token + 1) % vocab
            out.append(token)
            context.append(token)
        return out

    def _write(self, seq_id: int, start: int, tokens: list[int]) -> None:
        adapter = self.seq_adapters[seq_id]
        if adapter and adapter not in self.registered:
            raise ValueError(f"sequence {seq_id} computed with adapter {adapter!r}, which was dropped")
        table, bs, tag = self.tables[seq_id], self.block_size, adapter_tag(adapter)
        for pos, tok in enumerate(tokens, start):
            block = table[pos // bs]
            if block == NULL_BLOCK_ID:
                raise ValueError(f"sequence {seq_id} writes position {pos} into the null block")
            self.slots[block * bs + pos % bs] = tok | tag

    def _read(self, seq_id: int, length: int) -> list[int]:
        """The context a step at position length - 1 attends to: all of it, or its window."""
        table, bs = self.tables[seq_id], self.block_size
        first = max(length - self.window, 0) if self.window else 0
        if table[first // bs] == NULL_BLOCK_ID:
            raise ValueError(f"sequence {seq_id} reads position {first} from a released entry")
        return [self.slots[table[p // bs] * bs + p % bs] for p in range(first, length)]
