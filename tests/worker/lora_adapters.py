"""PEFT adapters for the LoRA tests, made by peft itself (the oracle): `get_peft_model` on the
tiny random HF model, lora_B randomized (PEFT initializes it to zero: a zero delta would test
nothing), `save_pretrained`. The oracle of a request on an adapter is that PEFT model's greedy
output (and the merged model's)."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    hf_model: transformers.PreTrainedModel,
    path: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] = ALL_MODULES,
    use_rslora: bool = False,
    std: float = 0.05,
) -> peft.PeftModel:
    """Save a random LoRA adapter of `hf_model` at `path`; return the PEFT model (a deep copy of
    the base: the base model itself stays untouched)."""
    import copy

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(path)
    return model.eval()


def peft_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()
