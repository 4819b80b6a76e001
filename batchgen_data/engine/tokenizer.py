"""Prompts to token ids and back: the checkpoint's tokenizer and chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen_data.engine.chat_template import ChatTemplateLimits, render_chat_template
from batchgen_data.errors import RequestError, one_line


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """A chat ``messages`` list with how to render it (vLLM's ``LLM.chat`` arguments):
    ``chat_template`` replaces the tokenizer's template, ``chat_template_kwargs`` are passed to
    it (``{"enable_thinking": False}`` for Qwen3)."""

    messages: list[dict]
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


Prompt = str | list[int] | list[dict] | ChatPrompt


class PromptTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded from the checkpoint folder (if it has one).

    Args:
        folder: the checkpoint folder.
        vocab_size: the model's vocabulary size (token ids must be below it).
        model_eos_ids: end-of-sequence ids from the model's config.
        chat_template_limits (ChatTemplateLimits, default 5 s and 16 M characters): each chat
            row's bound on rendering its template (``chat_template.py``).
    """

    def __init__(self, folder: str | Path, vocab_size: int, model_eos_ids: tuple[int, ...] = (),
                 chat_template_limits: ChatTemplateLimits = ChatTemplateLimits()):
        self.folder = Path(folder)
        self.vocab_size = vocab_size
        self.chat_template_limits = chat_template_limits
        self.hf = _load_hf_tokenizer(self.folder)
        eos = set(model_eos_ids) | _generation_config_eos(self.folder)
        if self.hf is not None and self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def encode(self, prompt: Any) -> list[int]:
        """Token ids for a string, a chat ``messages`` list, or a token-id list (validated)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            ids = self._require_hf("a text prompt").encode(prompt)
        elif isinstance(prompt, ChatPrompt):
            ids = self.apply_chat_template(list(prompt.messages), prompt.chat_template, prompt.chat_template_kwargs)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.apply_chat_template(list(prompt))
        elif isinstance(prompt, (list, tuple)) or _is_array(prompt):
            ids = [_as_token_id(t) for t in list(prompt)]
            if not ids:
                raise RequestError("empty prompt (no token ids)")
        else:
            raise RequestError(
                f"prompt must be a string, a list of token ids or a chat messages list, got {type(prompt).__name__}"
            )
        if not ids:
            raise RequestError("prompt encodes to zero tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the conversation rendered with the chat template (``chat_template``, or
        the tokenizer's) and a generation prompt, as transformers' ``apply_chat_template``,
        within ``chat_template_limits``; the keys of ``chat_template_kwargs`` are template
        variables."""
        hf = self._require_hf("a chat messages prompt")
        if not hf.chat_template and chat_template is None:
            raise RequestError(f"the tokenizer in {str(self.folder)!r} has no chat template")
        check_messages(messages)
        messages = normalize_messages(messages)
        try:
            source = hf.get_chat_template(chat_template)
            variables = {**hf.special_tokens_map, "add_generation_prompt": True, **(chat_template_kwargs or {})}
            text = render_chat_template(source, messages, variables, self.chat_template_limits)
        except RequestError:  # a per-row limit, in its own words
            raise
        except Exception as err:  # a template's raise_exception() or a jinja error: this row's fault
            raise RequestError(f"the chat template rejected the messages: {one_line(str(err))}") from None
        return hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return ""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's text alone, special tokens kept (logprobs' ``decoded_token``): what
        ``decode([t], skip_special_tokens=False)`` gives, in one call to the Rust tokenizer where
        the tokenizer has one and cleans up no spaces after it (~2.5x cheaper a token)."""
        if self.hf is None:
            return [""] * len(token_ids)
        backend = getattr(self.hf, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode_batch") and not self.hf.clean_up_tokenization_spaces:
            return backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        return [self.hf.decode([t], skip_special_tokens=False) for t in token_ids]

    def _require_hf(self, what: str):
        if self.hf is None:
            raise RequestError(f"{what} needs a tokenizer, and {str(self.folder)!r} has none")
        return self.hf


def _load_hf_tokenizer(folder: Path):
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def check_messages(messages: Any) -> None:
    """Raise ``RequestError`` unless ``messages`` is a non-empty list of ``{role, content}``
    objects: a string ``content``, or a list of OpenAI content parts of type ``"text"`` (a
    plain string is not a conversation; image, audio and video parts are not supported)."""
    if isinstance(messages, str) or not isinstance(messages, (list, tuple)):
        raise RequestError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise RequestError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"each message needs string 'role' and 'content', got {m!r}")
        _message_text(m)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Each message's content as one string: OpenAI text parts joined by newlines, as vLLM does
    for chat templates that take string content."""
    return [{**m, "content": _message_text(m)} for m in messages]


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)) or not content:
        raise RequestError(f"each message needs string 'role' and 'content', got {message!r}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _MULTIMODAL_PARTS:
            raise RequestError(f"multimodal input is not supported: a message has a {kind!r} content part "
                               "(only text parts are)")
        else:
            raise RequestError(f"a message content part must be {{'type': 'text', 'text': str}}, got {part!r}")
    return "\n".join(texts)


# OpenAI / vLLM content-part types that carry media.
_MULTIMODAL_PARTS = frozenset({"image_url", "image", "image_embeds", "input_audio", "audio_url", "audio",
                               "video_url", "video", "file"})


def _generation_config_eos(folder: Path) -> set[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())


def _is_array(x: Any) -> bool:
    return hasattr(x, "__array__") and hasattr(x, "tolist")


def _as_token_id(t: Any) -> int:
    if hasattr(t, "item") and not isinstance(t, (list, tuple)):
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, int):
        raise RequestError(f"token ids must be integers, got {t!r} ({type(t).__name__})")
    return t
