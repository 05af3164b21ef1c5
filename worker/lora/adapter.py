"""A PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) read, checked
against the served model, and held in the layout the forwards take.

For a target linear y = W x (+ b), PEFT adds  s · B (A x)  with A = lora_A [r, in],
B = lora_B [out, r] and s = alpha / r, or alpha / sqrt(r) with `use_rslora`. Here s is folded
into B once at load, and B is kept transposed:

    a  [r, in]   fp32   (lora_A as saved)        shrink:  t = x · aᵀ      [rows, r]
    bt [r, out]  fp32   (s · lora_Bᵀ)            expand:  y += t · bt     [rows, out]

so the expand is a row-axpy per rank (contiguous in `out`) in the C kernel and a plain matmul
in torch. Adapters stay in fp32 whatever the base's dtype or quantization: they are small
(rank x (in + out) per target) and the delta is then computed without a second rounding.

Everything is checked before an adapter exists: a bad checkpoint raises AdapterError naming
the file and what is wrong, and nothing of it is kept.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

import torch
from torch import Tensor

from worker.errors import AdapterError
from worker.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The seven projections an adapter may target, in the kernels' module index order.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# adapter_config.json options whose non-default values change the math in ways not served here.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "trainable_token_indices": (None,),
}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target projection of `config`'s layers."""
    hidden, q, kv, inter = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What adapter_config.json says, checked."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter. `weights[(layer, module index)] = (a, bt)` (see the module doc);
    targets absent from the checkpoint (or layers it skips) have no entry. `content_hash`:
    sha256 of both files' bytes (128 bits, hex): equal hashes mean equal deltas, so the prefix cache
    keys blocks by it and reloading other weights under one name never hits old blocks."""

    name: str
    path: str
    spec: AdapterSpec
    weights: dict[tuple[int, int], tuple[Tensor, Tensor]]
    content_hash: str
    # The fast CPU forward's C view of `weights` (worker/lora/cpu_apply.py), built on first use.
    kernel_table: object | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + bt.nbytes for a, bt in self.weights.values())

    def to(self, device: torch.device) -> LoraAdapter:
        """The same adapter with its tensors on `device` (no copy when already there)."""
        weights = {key: (a.to(device), bt.to(device)) for key, (a, bt) in self.weights.items()}
        return LoraAdapter(self.name, self.path, self.spec, weights, self.content_hash)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"adapter {what}: cannot read {path}: {exc.strerror or exc}") from exc


def parse_spec(raw: bytes, where: Path, max_rank: int) -> AdapterSpec:
    """adapter_config.json -> AdapterSpec, refusing what the forwards would get wrong."""
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not served (only LORA)")
    for key, allowed in _UNSUPPORTED.items():
        if key in cfg and cfg[key] not in allowed:
            raise AdapterError(f"{where}: {key}={cfg[key]!r} is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules must be a non-empty list of module names")
    missing = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(MODULES))
    if missing:
        raise AdapterError(
            f"{where}: target modules {missing} do not exist in this model (it has {', '.join(MODULES)})"
        )
    return AdapterSpec(rank, float(alpha), bool(cfg.get("use_rslora", False)), tuple(targets))


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT checkpoint in directory `path` for the model `config`."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter {name!r}: {root} is not a directory holding {CONFIG_FILE}")
    raw_config = _read(root / CONFIG_FILE, name)
    spec = parse_spec(raw_config, root / CONFIG_FILE, max_rank)
    raw = _read_writable(root / WEIGHTS_FILE, name)
    # The hash runs on a thread beside the parsing (hashlib releases the GIL on large buffers):
    # for a rank-16 adapter of a 0.5B model, ~35 MB, it is the largest part of a load.
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(content_hash, raw_config, raw)
        tensors = parse_safetensors(raw, root / WEIGHTS_FILE)
        weights = _weights(tensors, spec, config, root / WEIGHTS_FILE)
        return LoraAdapter(name, str(root), spec, weights, digest.result())


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def parse_safetensors(raw: memoryview, where: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file as views into `raw` (no copy: `_weights` makes the only
    one). The format: u64 little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}}, then the data. Anything inconsistent is an AdapterError naming the file."""
    bad = f"{where} is not a valid safetensors file"
    if len(raw) < 8:
        raise AdapterError(f"{bad}: {len(raw)} bytes")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise AdapterError(f"{bad}: its header claims {size} bytes, the file has {len(raw) - 8}")
    try:
        header = json.loads(bytes(raw[8 : 8 + size]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{bad}: unreadable header ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{bad}: the header is not an object")
    header.pop("__metadata__", None)
    data = raw[8 + size :]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = (
                _ST_DTYPES[entry["dtype"]],
                list(entry["shape"]),
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"{bad}: tensor {name!r} has an unsupported entry {entry!r}") from exc
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
            raise AdapterError(f"{bad}: tensor {name!r} lies outside the file or has the wrong size")
        tensors[name] = (
            torch.frombuffer(data[begin:end], dtype=dtype, count=count).view(shape)
            if count
            else torch.empty(shape, dtype=dtype)
        )
    return tensors


def _read_writable(path: Path, what: str) -> memoryview:
    """The file's bytes in a writable buffer (torch.frombuffer views need one), never zero-filled
    first (a bytearray's memset costs as much as the read)."""
    try:
        with path.open("rb") as f:
            raw = memoryview(torch.empty(path.stat().st_size, dtype=torch.uint8).numpy())
            if f.readinto(raw) != len(raw):
                raise AdapterError(f"adapter {what}: {path} changed size while being read")
            return raw
    except OSError as exc:
        raise AdapterError(f"adapter {what}: cannot read {path}: {exc.strerror or exc}") from exc


def content_hash(raw_config: bytes, raw_weights: bytes) -> str:
    """sha256 of both files, first 128 bits in hex (sha256: hardware-accelerated where the CPU
    has SHA extensions, ~1.5x blake2b's speed measured here)."""
    digest = sha256(raw_config)
    digest.update(raw_weights)
    return digest.hexdigest()[:32]


def _weights(tensors: dict[str, Tensor], spec: AdapterSpec, config: ModelConfig, where: Path) -> dict:
    """Pair every lora_A with its lora_B, check shapes against the base, fold the scaling."""
    shapes = module_shapes(config)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a served projection")
        layer, part, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or _PART[module] != part:
            raise AdapterError(f"{where}: {key!r} targets {part}.{module}, which this model lacks")
        if layer >= config.num_layers:
            raise AdapterError(
                f"{where}: {key!r} is for layer {layer}, but the base model has {config.num_layers} layers "
                "(an adapter of another base model?)"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{where}: holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        out_features, in_features = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise AdapterError(
                f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                f"do not have rank r={spec.rank}"
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise AdapterError(
                f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not "
                f"fit this base model ({module} is [{out_features}, {in_features}]: hidden size "
                f"{config.hidden_size}); an adapter of another base model?"
            )
        bt = torch.empty(spec.rank, out_features)
        torch.mul(b.t(), spec.scaling, out=bt)  # one pass: cast, scale and transpose
        weights[(layer, MODULES.index(module))] = (a.to(torch.float32, copy=True).contiguous(), bt)
    return weights
