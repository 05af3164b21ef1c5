"""What the soak's clients send: a seeded random mix of requests (`Spec`) over the served
model's geometry.

The mix is chosen for the bugs a soak finds and unit tests miss: n > 1 fan-outs whose samples
stop on their very first token (high temperature, many small stop ids), beam searches (groups
that fork, drop and are preempted whole beside everyone else), prompts that cross
block boundaries and share prefixes (prefix-cache hits and copy-on-write), lengths that
overflow a tight KV pool (preemption), and the client behaviours that race the engine (early
cancels, deadlines, aborts from another client, request ids reused after a finish). A few
hostile requests (huge request id / cache salt / text / stop-id list) check that one
client's oversized request cannot stall or fail everybody else's.

Every spec fits the pool running alone (prompt + max_tokens <= pool tokens), so
RESOURCE_EXHAUSTED is a violation for ordinary requests; hostile ones may be refused.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from base.v1 import engine_pb2

HUGE_STOP_ID = 300  # >= 128: two bytes per id on the wire, so the list is big but cheap to build
PROFILES = ("mixed", "fanout")
BEAM_FRACTION = 0.12  # of the mixed profile's requests


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the generator needs from ModelInfo."""

    vocab_size: int
    block_size: int
    pool_tokens: int  # (num_blocks - 1) * block_size: the most one sequence can ever hold
    max_n: int
    eos_token_ids: tuple[int, ...]
    max_beam_width: int = 0

    @classmethod
    def from_model_info(cls, info: engine_pb2.ModelInfo) -> Geometry:
        return cls(
            vocab_size=info.facts.vocab_size,
            block_size=info.facts.block_size,
            pool_tokens=min(info.facts.max_model_len, (info.facts.num_blocks - 1) * info.facts.block_size),
            max_n=min(info.max_n, info.max_num_seqs),
            eos_token_ids=tuple(info.facts.eos_token_ids),
            max_beam_width=info.max_beam_width,
        )


@dataclass(slots=True)
class Spec:
    """One request and how the client treats it.

    kind: "plain" (read to the end), "cancel" (stop reading after `cancel_after` messages),
    "deadline" (gRPC deadline `deadline_s`), "reuse" (a second request reuses the id after the
    first finished), or "hostile-<what>" (may be refused with INVALID_ARGUMENT /
    RESOURCE_EXHAUSTED; must not hurt anyone else).
    """

    kind: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    request_id: str = ""
    cache_salt: str = ""
    priority: int = 0
    text: str = ""  # sent instead of `prompt` when set (hostile-text)
    abortable: bool = False  # other clients may Abort it while it is live
    cancel_after: int = 0
    deadline_s: float | None = None
    huge_stop_ids: int = 0  # appended on the wire as raw bytes (see `request_message`)
    beam_width: int = 0  # >= 2: beam search (n = beams returned)
    length_penalty: float = 1.0

    def stop_set(self) -> set[int]:
        """Token ids that must end a sample (the model's EOS unless ignore_eos)."""
        ids = set(self.stop_token_ids)
        if self.huge_stop_ids:
            ids.add(HUGE_STOP_ID)
        return ids

    def request_message(self) -> engine_pb2.GenerateRequest:
        sampling = engine_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            n=self.n,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty if self.beam_width else None,
        )
        req = engine_pb2.GenerateRequest(
            request_id=self.request_id,
            text=self.text,
            token_ids=[] if self.text else self.prompt,
            sampling=sampling,
            cache_salt=self.cache_salt,
            priority=self.priority,
        )
        if self.huge_stop_ids:
            req = engine_pb2.GenerateRequest.FromString(req.SerializeToString() + _huge_stop_ids(self))
        return req


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _huge_stop_ids(spec: Spec) -> bytes:
    """`sampling.stop_token_ids` += [HUGE_STOP_ID] * spec.huge_stop_ids, as wire bytes.

    Serialized protobuf messages merge when concatenated (repeated fields append), so the
    list is built as bytes in milliseconds instead of a Python list of millions of ints."""
    packed = _varint(HUGE_STOP_ID) * spec.huge_stop_ids
    stop_field = b"\x32" + _varint(len(packed)) + packed  # field 6, length-delimited (packed)
    return b"\x22" + _varint(len(stop_field)) + stop_field  # GenerateRequest.sampling = field 4


class Workload:
    """Seeded generator of Specs for one profile over one geometry."""

    def __init__(
        self,
        geo: Geometry,
        profile: str = "mixed",
        seed: int = 0,
        hostile_bytes: int = 1 << 20,
        max_tokens: int = 64,
    ):
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; one of {PROFILES}")
        self.geo = geo
        self.profile = profile
        self.hostile_bytes = hostile_bytes
        self.max_tokens = max_tokens  # of the mixed profile (the fan-out profile uses <= 16)
        rng = random.Random(seed)
        # Shared prefixes (some block-aligned, some not) make prefix-cache hits across clients.
        self.prefixes = [self._tokens(rng, rng.randint(geo.block_size, 6 * geo.block_size)) for _ in range(6)]

    def _tokens(self, rng: random.Random, length: int) -> list[int]:
        return [rng.randrange(256) for _ in range(length)]  # bytes: valid for any tokenizer >= 256

    def prompt(self, rng: random.Random, max_len: int) -> list[int]:
        length = rng.randint(1, max(1, max_len))
        if rng.random() < 0.4:
            prefix = rng.choice(self.prefixes)[:length]
            return prefix + self._tokens(rng, length - len(prefix))
        return self._tokens(rng, length)

    def next_spec(self, rng: random.Random) -> Spec:
        if self.profile == "fanout":
            return self._fanout(rng)
        r = rng.random()
        kind = "plain" if r < 0.55 else "cancel" if r < 0.72 else "deadline" if r < 0.82 else "reuse"
        spec = self._mixed(rng, kind)
        if kind == "cancel":
            spec.cancel_after = rng.randint(0, 6)
        elif kind == "deadline":
            spec.deadline_s = rng.uniform(0.02, 3.0)
        return spec

    def _mixed(self, rng: random.Random, kind: str) -> Spec:
        geo = self.geo
        max_tokens = rng.randint(1, min(self.max_tokens, geo.pool_tokens // 2))
        spec = Spec(
            kind, self.prompt(rng, min(12 * geo.block_size, geo.pool_tokens - max_tokens)), max_tokens
        )
        spec.n = rng.choice((1, 1, 2, 3, 4)) if geo.max_n >= 4 else rng.randint(1, geo.max_n)
        if rng.random() < BEAM_FRACTION and self._make_beam_search(rng, spec):
            pass
        elif rng.random() < 0.7:
            spec.temperature = rng.choice((0.5, 1.0, 2.0, rng.uniform(0.1, 5.0)))
            spec.seed = rng.randrange(2**32) if rng.random() < 0.7 else None
            spec.top_p = rng.choice((1.0, 1.0, 0.9, 0.5))
            spec.top_k = rng.choice((0, 0, 0, 5, 50))
        r = rng.random()
        if r < 0.25:  # many small ids: at high temperature some sample stops on its first token
            spec.stop_token_ids = list(range(rng.randint(8, 160)))
        elif r < 0.5:
            spec.stop_token_ids = [rng.randrange(geo.vocab_size) for _ in range(rng.randint(1, 8))]
        if spec.beam_width:  # each stop id adds beam_width candidates per beam
            spec.stop_token_ids = spec.stop_token_ids[:8]
        spec.ignore_eos = rng.random() < 0.3
        spec.logprobs = rng.random() < 0.2
        spec.cache_salt = rng.choice(("", "", "", "", "tenant-a", "tenant-b"))
        spec.priority = rng.choice((0, 0, 0, -1, 1))
        spec.abortable = kind in ("plain", "deadline") and rng.random() < 0.3
        return spec

    def _make_beam_search(self, rng: random.Random, spec: Spec) -> bool:
        """Turn `spec` into a beam search that fits the pool running alone (width x (prompt +
        max_tokens + a block) tokens); False, unchanged, when no width >= 2 fits."""
        geo = self.geo
        width = rng.randint(2, max(2, min(4, geo.max_beam_width)))
        room = geo.pool_tokens // width - geo.block_size
        if geo.max_beam_width < 2 or room < 2:
            return False
        spec.max_tokens = min(spec.max_tokens, room // 2)
        spec.prompt = spec.prompt[: room - spec.max_tokens] or spec.prompt[:1]
        spec.beam_width, spec.n = width, rng.randint(1, width)
        spec.length_penalty = rng.choice((1.0, 1.0, 0.0, 2.0, -0.5))
        return True

    def _fanout(self, rng: random.Random) -> Spec:
        """n > 1, high temperature, stop ids = many small vocab ids: samples end on their
        first token at the fan-out (the block leak of issue 12)."""
        geo = self.geo
        max_tokens = rng.randint(1, min(16, geo.pool_tokens // 4))
        spec = Spec(
            "plain", self.prompt(rng, min(4 * geo.block_size, geo.pool_tokens - max_tokens)), max_tokens
        )
        spec.n = rng.randint(2, max(2, min(4, geo.max_n)))
        spec.temperature = rng.uniform(3.0, 5.0)
        spec.seed = rng.randrange(2**32) if rng.random() < 0.5 else None
        spec.stop_token_ids = list(range(rng.randint(64, min(256, geo.vocab_size))))
        spec.ignore_eos = rng.random() < 0.5
        if rng.random() < 0.15:
            spec.kind, spec.cancel_after = "cancel", rng.randint(0, 3)
        return spec

    def hostile(self, rng: random.Random, what: str) -> Spec:
        """One oversized field: "id", "salt", "text" (`hostile_bytes` each) or "stop" (a
        stop-id list of ~40 MiB with n = 3: every fan-out plan repeats it per sample)."""
        spec = Spec(f"hostile-{what}", self._tokens(rng, 2 * self.geo.block_size + 1), 4, n=1)
        size = self.hostile_bytes
        if what == "id":
            spec.request_id = "i" * size
        elif what == "salt":
            spec.cache_salt = "s" * size
        elif what == "text":
            spec.text = "t" * size
        elif what == "stop":
            spec.n, spec.temperature, spec.seed, spec.max_tokens = min(3, self.geo.max_n), 1.0, 7, 8
            spec.huge_stop_ids = 20 * 1024 * 1024
        else:
            raise ValueError(f"unknown hostile field {what!r}")
        return spec


def probe_specs(geo: Geometry) -> list[Spec]:
    """Requests run alone at the start and again at the end: the same tokens prove the server
    was not poisoned. A salt of their own keeps them off the prefix cache, so both runs do the
    very same computation (a cache hit would change float summation order)."""
    rng = random.Random(12345)
    length = min(3 * geo.block_size + 1, geo.pool_tokens // 2)
    prompt = [rng.randrange(256) for _ in range(length)]
    max_tokens = max(1, min(24, geo.pool_tokens // 4))
    greedy = Spec("probe", prompt, max_tokens, ignore_eos=True)
    seeded = Spec(
        "probe", prompt, max_tokens, n=min(3, geo.max_n), temperature=1.0, seed=4242, ignore_eos=True
    )
    return [greedy, seeded]
