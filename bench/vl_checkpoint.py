"""A tiny random Qwen3-VL checkpoint written by transformers (config, safetensors, a byte-level
tokenizer with the model's special tokens, a Qwen3-VL-style chat template and a preprocessor
config), the matching Hugging Face processor, and test images made with Pillow.

The reference is transformers' own `Qwen3VLForConditionalGeneration` read back from the same
directory, driven through its own processor (Pillow backend) and chat template. Shared by the
oracle tests (tests/worker/test_vl_*.py, tests/grpc, tests/openai) and the `vision` bench suite;
needs transformers (the test extra)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from PIL import Image

SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# Qwen3-VL's template, reduced to what the tests use: string or list content, image parts
# rendered as <|vision_start|><|image_pad|><|vision_end|>.
VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PATCH, MERGE = 16, 2  # Qwen3-VL's geometry (Qwen2.5-VL: FAMILIES["qwen2.5-vl"])
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 2, 32 * 32 * 20  # 2 .. 20 placeholder tokens per image
WEIGHT_STD = 0.2
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class Family:
    """One model family's tiny test geometry and its transformers classes."""

    model_class: str
    processor_class: str
    patch: int
    mean: list
    std: list
    text: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)

    @property
    def min_pixels(self) -> int:
        return (self.patch * MERGE) ** 2 * 2

    def max_pixels(self, tokens: int = 20) -> int:
        return (self.patch * MERGE) ** 2 * tokens


FAMILIES = {
    "qwen3-vl": Family(
        "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 16, [0.5] * 3, [0.5] * 3,
        text=dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        vision=dict(depth=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
    ),
    "qwen2.5-vl": Family(
        "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 14, CLIP_MEAN, CLIP_STD,
        text=dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=3, window_size=56, fullatt_block_indexes=[1]),  # windows of 2 x 2 tokens
    ),
}  # fmt: skip


def write_byte_bpe_tokenizer(path: Path, special_tokens: list[str]):
    """tokenizer.json at `path`: a byte-level BPE with no merges (ids 0-255: the bytes, as
    GPT-2's alphabet), then `special_tokens` in order. Returns the `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.save(str(path / "tokenizer.json"))
    return tok


def write_tokenizer(path: Path, max_pixels: int = MAX_PIXELS, family: str = "qwen3-vl") -> dict[str, int]:
    fam = FAMILIES[family]
    tok = write_byte_bpe_tokenizer(path, SPECIAL_TOKENS)
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": VL_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(VL_TEMPLATE)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": fam.patch,
        "merge_size": MERGE,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": fam.min_pixels, "longest_edge": max_pixels},
        "image_mean": fam.mean,
        "image_std": fam.std,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def build_vl_checkpoint(
    path: Path,
    seed: int = 0,
    text_layers: int = 3,
    max_pixels: int | None = None,
    family: str = "qwen3-vl",
    hidden_size: int = 64,
):
    """Save the model at `path`; return transformers' model read back from it (fp32, eager).
    `hidden_size`: the decoder's width (the benchmark's larger model; heads of 32 or more)."""
    fam = FAMILIES[family]
    max_pixels = max_pixels or fam.max_pixels()
    ids = write_tokenizer(path, max_pixels, family)
    eos = ids["<|im_end|>"]
    config_class = getattr(transformers, fam.model_class.replace("ForConditionalGeneration", "Config"))
    config = config_class(
        text_config=dict(
            vocab_size=len(ids) + 256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=text_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            eos_token_id=eos, bos_token_id=None, **fam.text,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
            patch_size=fam.patch, spatial_merge_size=MERGE, temporal_patch_size=2, **fam.vision,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_class = getattr(transformers, fam.model_class)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)
    model.save_pretrained(path)
    reference = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    reference.generation_config.eos_token_id = None  # exactly max_new_tokens tokens
    return reference


def processor(path: Path, family: str = "qwen3-vl"):
    """Hugging Face's processor of the family on the checkpoint's tokenizer, Pillow image backend
    (what the checkpoint's preprocessor_config.json says)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fam = FAMILIES[family]
    settings = json.loads((path / "preprocessor_config.json").read_text())
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=fam.patch, merge_size=MERGE, temporal_patch_size=2, size=settings["size"],
        image_mean=fam.mean, image_std=fam.std,
    )  # fmt: skip
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    processor_class = _image_only(getattr(transformers, fam.processor_class))
    return processor_class(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=VL_TEMPLATE
    )


def _image_only(base: type) -> type:
    """The processor unchanged, except that it accepts no video processor: transformers' video
    processors need torchvision, which the CPU test venv does not carry (images never touch it)."""

    class ImageOnly(base):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnly


def make_image(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    """A PNG of smooth gradients plus seeded noise (resizing a pure noise image is a poor test of
    interpolation; a pure gradient makes different images too alike)."""
    generator = torch.Generator().manual_seed(seed)
    ys = torch.linspace(0, 1, height)[:, None, None]
    xs = torch.linspace(0, 1, width)[None, :, None]
    phase = torch.rand(1, 1, 3, generator=generator) * 6
    smooth = 0.5 + 0.5 * torch.sin(phase + 5 * xs + 3 * ys * (1 + phase))
    noise = torch.rand(height, width, 3, generator=generator)
    pixels = ((0.8 * smooth + 0.2 * noise) * 255).to(torch.uint8).numpy()
    image = Image.fromarray(pixels, "RGB")
    if mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def hf_generate(reference, proc, messages: list[dict], images: list[bytes], num_tokens: int):
    """(expanded prompt ids, image_grid_thw rows, greedy tokens) from transformers."""
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pil_images = [Image.open(io.BytesIO(data)) for data in images] or None
    inputs = proc(text=[text], images=pil_images, return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()] if images else []
    return prompt, grids, out[0, len(prompt) :].tolist(), inputs
