"""Chat prompts: the checkpoint's chat template, rendered the way transformers renders it.

Where the template comes from (first found): `--chat-template FILE` (a Jinja file, as vLLM
takes it); the model directory's `tokenizer_config.json` `chat_template` (a string, or a list
of {name, template} of which "default" is used); its `chat_template.jinja`; its
`chat_template.json`; a GGUF model's `tokenizer.chat_template` metadata (`--model FILE.gguf`, or
a directory holding one .gguf and no config.json), with its special-token strings from
`tokenizer.ggml.*_token_id`. The embedded default model (byte tokenizer, no tokenizer_config.json)
uses `DEFAULT_TEMPLATE` below. Any other model without a template cannot serve chat: a
guessed template would silently feed the model a prompt format it was never trained on.

Rendering matches `transformers.PreTrainedTokenizerBase.apply_chat_template`: a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, loop controls, the `raise_exception`,
`strftime_now` and non-escaping `tojson` helpers, a no-op `{% generation %}` tag, and the
variables `messages`, `add_generation_prompt`, `tools`, `documents` and the tokenizer's
special-token strings (`bos_token`, `eos_token`, ...) from tokenizer_config.json.

The rendered text goes to the Engine as text. Its Hugging Face tokenizer matches added tokens
(`<|im_start|>`, `<s>`, ...) inside text even without special tokens (add_special_tokens=False
only skips the post-processor's BOS/EOS), exactly what transformers does with a rendered
chat, so special tokens in the template reach the model as their single ids
(tests/openai/test_chat.py proves it token by token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedkv.openai_api.errors import ApiError, bad_request

# The embedded default model's template: ChatML markers written as plain text. Its byte
# tokenizer has no special-token strings (BOS 256 / EOS 257 exist only as ids), so the markers
# are ordinary UTF-8 bytes and no BOS is inserted. The model's weights are random: this only
# gives chat clients a well-defined prompt to exercise the whole path.
DEFAULT_TEMPLATE = (
    # With tools: a system turn listing them and the call format (Hermes/Qwen's), assistant
    # calls as <tool_call> blocks, tool results as <tool_response> in a user turn. Without
    # tools and tool turns the rendering is the plain one (the same as before tools existed).
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\n\nFor each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') }}"
    "{{ '\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson }}{{ '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged, so templates that use it work."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass
class ChatTemplate:
    """A compiled template and the special-token strings it may use."""

    source: str  # where it came from, for messages
    text: str
    special_tokens: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self._template = compile_template(self.text)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template from {self.source} does not compile: {e}") from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        extra: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text; a template's raise_exception (e.g. roles out of order) is a 400."""
        variables = {**self.special_tokens, **(extra or {})}  # as transformers: kwargs win
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise bad_request(f"the chat template failed on the messages: {e!r}", "messages") from None


def default_template() -> ChatTemplate:
    return ChatTemplate("the embedded default model's template (docs/OPENAI.md)", DEFAULT_TEMPLATE)


def _token_text(value):
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _special_tokens(model_dir: Path | None) -> dict:
    if model_dir is None:
        return {}
    config = {
        **_read_json(model_dir / "special_tokens_map.json"),
        **_read_json(model_dir / "tokenizer_config.json"),
    }
    tokens = {k: _token_text(config[k]) for k in _SPECIAL_TOKEN_KEYS if config.get(k) is not None}
    return {k: v for k, v in tokens.items() if v is not None}


def _template_in_dir(model_dir: Path) -> tuple[str, str] | None:
    """(source, template text) of a checkpoint directory, or None."""
    config_path = model_dir / "tokenizer_config.json"
    template = _read_json(config_path).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return str(config_path), template
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return str(jinja_path), jinja_path.read_text(encoding="utf-8")
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, str):
        return str(model_dir / "chat_template.json"), template
    return None


def _gguf_file(model: Path) -> Path | None:
    """The .gguf file `--model` names (itself, or the one in a directory without config.json)."""
    if model.is_file():
        return model if model.suffix.lower() == ".gguf" else None
    if (model / "config.json").is_file():
        return None
    found = sorted(model.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def _gguf_template(path: Path) -> tuple[str | None, dict]:
    """(tokenizer.chat_template, special-token strings) from a GGUF file's metadata, read with
    llama.cpp's reader (the worker builds the same file's tokenizer: worker/gguf/tokenizer.py)."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
        template = (
            fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
        )
        tokens = fields.get("tokenizer.ggml.tokens")
        special = {}
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            field = fields.get(f"tokenizer.ggml.{key}_token_id")
            if field is not None and tokens is not None and 0 <= int(field.contents()) < len(tokens.data):
                special[name] = tokens.contents(int(field.contents()))
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template of GGUF {path}: {e}") from None
    return template, special


def load_chat_template(model_dir: str | None = None, template_file: str | None = None) -> ChatTemplate | None:
    """The template from `--chat-template FILE` or the model directory (or GGUF file); None when
    neither has one (then only the byte-tokenizer default model can chat: see `template_for`)."""
    directory = Path(model_dir) if model_dir else None
    gguf = _gguf_file(directory) if directory is not None and directory.exists() else None
    if gguf is not None:
        template, special = _gguf_template(gguf)
        found = None if template is None else (f"{gguf} (tokenizer.chat_template)", template)
        return _chosen(template_file, found, special)
    if directory is not None and not directory.is_dir():
        raise ValueError(f"--model {model_dir!r} is not a directory or a .gguf file")
    special = _special_tokens(directory)
    found = _template_in_dir(directory) if directory is not None else None
    return _chosen(template_file, found, special)


def _chosen(template_file: str | None, found: tuple[str, str] | None, special: dict) -> ChatTemplate | None:
    """--chat-template FILE wins over the model's own template."""
    if template_file:
        path = Path(template_file)
        try:
            return ChatTemplate(str(path), path.read_text(encoding="utf-8"), special)
        except OSError as e:
            raise ValueError(f"cannot read --chat-template {template_file!r}: {e.strerror or e}") from None
    if found is None:
        return None
    return ChatTemplate(found[0], found[1], special)


def template_for(loaded: ChatTemplate | None, engine_tokenizer: str) -> ChatTemplate:
    """The template a chat request uses: the loaded one, else the default model's (byte
    tokenizer only), else a 400 that says how to give one."""
    if loaded is not None:
        return loaded
    if engine_tokenizer == "byte":
        return default_template()
    raise ApiError(
        400,
        "no chat template for this model: start the front with --model DIR (a checkpoint whose "
        "tokenizer_config.json has chat_template) or --chat-template FILE; /v1/completions works without one",
        code="no_chat_template",
    )
