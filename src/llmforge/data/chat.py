"""Chat templates for supervised fine-tuning: conversations -> token ids + a loss mask.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content":
str}`` (the OpenAI / Hugging Face ``messages`` format). The Llama 3 template renders it as
(Meta's ``ChatFormat`` in llama-models ``llama3/tokenizer.py``; the ``chat_template`` of the
Llama 3 Instruct ``tokenizer_config.json``; torchtune's ``Llama3Tokenizer``)::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{prompt}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{response}<|eot_id|>

(one string, no line breaks between messages; contents are stripped of surrounding whitespace,
as Meta and the HF template do). ``<|begin_of_text|>``, ``<|start_header_id|>``,
``<|end_header_id|>`` and ``<|eot_id|>`` must be *single* tokens of the tokenizer: the Llama 3
tiktoken ``tokenizer.model`` and HF ``tokenizer.json`` have them, and llmforge's trained BPE
adds them (:data:`llmforge.data.tokenizers.BPE_SPECIAL_TOKENS`).

Loss mask: the content tokens of every assistant message and the ``<|eot_id|>`` that ends it are
targets (so the model learns to stop); the begin-of-text token, every header (the assistant's
too) and all system/user tokens are not. Text between special tokens is encoded piece by piece
(``role``, ``"\\n\\n"``, ``content``); because contents are stripped, this gives the same ids as
encoding the rendered string with special-token parsing (both tokenizers' pre-tokenizers split
``"\\n\\n"`` from a following non-space character).
"""

from __future__ import annotations

from typing import Any

from llmforge.errors import ConfigError

__all__ = ["ChatTemplate", "Llama3ChatTemplate", "ChatMLTemplate", "CHAT_TEMPLATES", "ROLES", "render_llama3",
           "build_chat_template"]

#: Roles a message may have.
ROLES = ("system", "user", "assistant")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def render_llama3(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The Llama 3 chat string of ``messages`` (see the module docstring), exactly as the
    Llama 3 Instruct ``chat_template`` renders it; ``add_generation_prompt`` appends the
    assistant header ``<|start_header_id|>assistant<|end_header_id|>\n\n`` (what a model
    continues at inference)."""
    out = ["<|begin_of_text|>"]
    for m in messages:
        out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
                   f"{m['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


class ChatTemplate:
    """Base class: ``tokenize(messages) -> (ids, targets)``, ``prompt_ids(messages)``."""

    name = ""

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of ``messages`` plus the opening of an assistant turn (for generation)."""
        raise NotImplementedError

    def tokenize(self, messages: list[dict[str, str]],
                 train_on_input: bool = False) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per id, whether it is a loss target."""
        raise NotImplementedError

    @property
    def stop_id(self) -> int:
        """The id that ends an assistant turn (a target; generation stops there)."""
        raise NotImplementedError


class Llama3ChatTemplate(ChatTemplate):
    """The Llama 3 template over a llmforge :class:`~llmforge.data.tokenizers.Tokenizer`.

    Raises:
        ConfigError: the tokenizer lacks one of ``<|begin_of_text|>``, ``<|start_header_id|>``,
            ``<|end_header_id|>``, ``<|eot_id|>`` as a single token.
    """

    name = "llama3"

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        ids = {t: tokenizer.token_id(t) for t in LLAMA3_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ConfigError(
                f"data.chat_template=llama3 needs the single tokens {list(LLAMA3_TOKENS)}, but "
                f"the tokenizer ({tokenizer!r}) lacks {missing}; use a Llama 3 tokenizer "
                "(tokenizer.type: tiktoken or huggingface with a Llama 3 tokenizer.json) or "
                "tokenizer.type: train_bpe (it adds them; a tokenizer saved by an older llmforge "
                "version must be trained again)")
        self.bos = ids["<|begin_of_text|>"]
        self.start_header = ids["<|start_header_id|>"]
        self.end_header = ids["<|end_header_id|>"]
        self.eot = ids["<|eot_id|>"]
        self._nl2 = tokenizer.encode("\n\n")
        self._roles = {r: tokenizer.encode(r) for r in ROLES}

    @property
    def stop_id(self) -> int:
        return self.eot

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of ``messages`` followed by the assistant header (``render_llama3(messages,
        add_generation_prompt=True)``): the prompt a chat model continues; it should stop at
        :attr:`stop_id`."""
        ids, _ = self.tokenize(messages)
        return ids + [self.start_header, *self._roles["assistant"], self.end_header, *self._nl2]

    def tokenize(self, messages: list[dict[str, str]],
                 train_on_input: bool = False) -> tuple[list[int], list[bool]]:
        """``(ids, targets)`` of equal length: ``ids[0]`` is ``<|begin_of_text|>``;
        ``targets[i]`` is True for assistant content and its closing ``<|eot_id|>`` (and, with
        ``train_on_input``, for system/user content and their ``<|eot_id|>`` too; headers and
        begin-of-text are never targets)."""
        ids: list[int] = [self.bos]
        targets: list[bool] = [False]
        contents = self.tok.encode_batch([m["content"].strip() for m in messages])
        for m, body in zip(messages, contents):
            header = [self.start_header, *self._roles[m["role"]], self.end_header, *self._nl2]
            ids += header
            targets += [False] * len(header)
            target = m["role"] == "assistant" or train_on_input
            ids += body + [self.eot]
            targets += [target] * (len(body) + 1)
        return ids, targets


class ChatMLTemplate(ChatTemplate):
    """ChatML, the template of Qwen (Qwen2.5, Qwen3 ``tokenizer_config.json``): each message is
    ``<|im_start|>{role}\n{content}<|im_end|>\n``; a generation prompt adds
    ``<|im_start|>assistant\n``. Targets: assistant content and its ``<|im_end|>`` (with
    ``train_on_input`` system/user content too); no begin-of-text token.

    Raises:
        ConfigError: the tokenizer lacks ``<|im_start|>`` or ``<|im_end|>`` as a single token.
    """

    name = "chatml"

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        ids = {t: tokenizer.token_id(t) for t in ("<|im_start|>", "<|im_end|>")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ConfigError(f"data.chat_template=chatml needs the single tokens <|im_start|> and "
                              f"<|im_end|>, but the tokenizer ({tokenizer!r}) lacks {missing}; use "
                              "a Qwen tokenizer.json (tokenizer.type: huggingface)")
        self.start, self.end = ids["<|im_start|>"], ids["<|im_end|>"]
        self._nl = tokenizer.encode("\n")
        self._roles = {r: tokenizer.encode(r) for r in ROLES}

    @property
    def stop_id(self) -> int:
        return self.end

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids, _ = self.tokenize(messages)
        return ids + [self.start, *self._roles["assistant"], *self._nl]

    def tokenize(self, messages: list[dict[str, str]],
                 train_on_input: bool = False) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        targets: list[bool] = []
        contents = self.tok.encode_batch([m["content"].strip() for m in messages])
        for m, body in zip(messages, contents):
            header = [self.start, *self._roles[m["role"]], *self._nl]
            target = m["role"] == "assistant" or train_on_input
            ids += header + body + [self.end] + self._nl
            targets += [False] * len(header) + [target] * (len(body) + 1) + [False] * len(self._nl)
        return ids, targets


#: ``data.chat_template`` values.
CHAT_TEMPLATES = {"llama3": Llama3ChatTemplate, "chatml": ChatMLTemplate}


def build_chat_template(name: str, tokenizer: Any) -> ChatTemplate:
    """The template named by ``data.chat_template`` over ``tokenizer``.

    Raises:
        ConfigError: unknown name, or the tokenizer lacks the template's special tokens.
    """
    if name not in CHAT_TEMPLATES:
        raise ConfigError(f"data.chat_template: unknown template {name!r}; use one of "
                          f"{', '.join(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES[name](tokenizer)
