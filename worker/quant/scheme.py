"""What `config.json`'s `quantization_config` says, checked: one `QuantScheme`, or a
ModelLoadError naming the field and value pagedkv does not serve.

    AutoAWQ GEMM        quant_method awq, version gemm, bits 4, zero_point, group 32/64/128
    GPTQ (v1 / v2)      quant_method gptq, bits 4 or 8, sym or not, desc_act false (a
                        desc_act checkpoint whose g_idx is the trivial k // group loads too:
                        checked per tensor at load), checkpoint_format gptq / gptq_v2
    compressed-tensors  quant_method compressed-tensors, format pack-quantized (W4A16, W8A16:
                        int weights, group or channel) or int-quantized (W8A8: int8 channel
                        weights, int8 dynamic per-token activations)

Everything else (3-bit, FP8, NF4, static activation scales, ...) is refused up front, before
any tensor is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from worker.errors import ModelLoadError


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "awq" | "gptq" | "compressed-tensors"
    format: str  # "awq-gemm" | "gptq" | "gptq_v2" | "pack-quantized" | "int-quantized"
    bits: int  # 4 | 8
    group_size: int  # input features per scale; 0 = one group spanning the whole input (channel)
    symmetric: bool  # zero point fixed at 2^(bits - 1) (codes stored unsigned)
    activations: str = "none"  # "none": weight-only; "int8-token": W8A8, dynamic per-token scale
    ignored: tuple[str, ...] = ()  # module names / "re:" patterns left unquantized (lm_head ...)

    def describe(self) -> str:
        group = "channel" if self.group_size == 0 else f"g{self.group_size}"
        sym = "sym" if self.symmetric else "asym"
        acts = "" if self.activations == "none" else " a8 dynamic per token"
        return f"{self.method} ({self.format}) int{self.bits} {group} {sym}{acts}"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (e.g. "model.layers.0.mlp.up_proj") is quantized."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern) or module.split(".")[-1] == pattern:
                return False
        return True


def _refuse(field: str, value, supported: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config.{field} = {value!r} is not supported: {supported}")


def parse_quant_config(config: dict) -> QuantScheme | None:
    """The checkpoint's scheme, or None for an unquantized checkpoint."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse("quant_method", qc.get("quant_method"), "awq, gptq or compressed-tensors")


def _group(value, field: str = "group_size") -> int:
    if value in (None, -1, 0):
        return 0
    if not isinstance(value, int) or value < 2 or value % 2:
        raise _refuse(field, value, "a positive even number of input features, or -1 (per channel)")
    return value


def _awq(qc: dict) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", qc.get("version"), "gemm (AutoAWQ's GEMM layout)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    group = _group(qc.get("group_size", qc.get("q_group_size")))
    if group == 0:
        raise _refuse("group_size", qc.get("group_size"), "a group size (AWQ GEMM is group-wise)")
    zero_point = qc.get("zero_point", True)
    ignored = tuple(qc.get("modules_to_not_convert") or ()) + (
        "lm_head",
    )  # AutoAWQ quantizes the blocks only
    return QuantScheme("awq", "awq-gemm", 4, group, not zero_point, ignored=ignored)


def _gptq(qc: dict) -> QuantScheme:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "4 or 8")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", qc.get("checkpoint_format"), "gptq or gptq_v2")
    group = _group(qc.get("group_size"))
    ignored = tuple(qc.get("modules_to_not_convert") or ())
    if not qc.get("lm_head", False):  # GPTQ tools leave lm_head unquantized unless told `lm_head: true`
        ignored += ("lm_head",)
    return QuantScheme("gptq", fmt, bits, group, bool(qc.get("sym", True)), ignored=ignored)


def _compressed_tensors(qc: dict) -> QuantScheme:
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _refuse("format", fmt, "pack-quantized (W4A16 / W8A16) or int-quantized (W8A8)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one quantization group")
    ((name, group),) = groups.items()
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    where = f"config_groups.{name}.weights"
    if weights.get("type", "int") != "int":
        raise _refuse(f"{where}.type", weights.get("type"), "int")
    bits = weights.get("num_bits")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"{where}.strategy", strategy, "group or channel")
    group_size = _group(weights.get("group_size"), f"{where}.group_size") if strategy == "group" else 0
    if strategy == "group" and group_size == 0:
        raise _refuse(f"{where}.group_size", weights.get("group_size"), "a positive even group size")
    if weights.get("actorder") not in (None, False, "static", "weight"):  # "group" stores a g_idx
        raise _refuse(f"{where}.actorder", weights.get("actorder"), "none, static or weight")
    symmetric = bool(weights.get("symmetric", True))
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise _refuse(f"{where}.num_bits", bits, "4 or 8")
        if acts is not None:
            raise _refuse(f"config_groups.{name}.input_activations", acts, "none with pack-quantized")
        activations = "none"
    else:
        if bits != 8 or strategy != "channel" or not symmetric:
            raise _refuse(where, weights, "int8 symmetric per-channel weights with int-quantized")
        acts = acts or {}
        if (acts.get("num_bits"), acts.get("type", "int"), acts.get("strategy"), acts.get("dynamic")) != (
            8,
            "int",
            "token",
            True,
        ):
            raise _refuse(f"config_groups.{name}.input_activations", acts, "int8 dynamic per-token scales")
        if not acts.get("symmetric", True):
            raise _refuse(f"config_groups.{name}.input_activations.symmetric", False, "symmetric")
        activations = "int8-token"
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise _refuse(f"config_groups.{name}.targets", targets, '["Linear"]')
    return QuantScheme("compressed-tensors", fmt, bits, group_size, symmetric, activations,
                       tuple(qc.get("ignore") or ()))  # fmt: skip
