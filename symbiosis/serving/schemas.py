"""Request bodies of the OpenAI-compatible API (pydantic); responses are plain dicts.

Field names and defaults follow OpenAI's API (and vLLM's extras ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``repetition_penalty``). Parameters we do not implement are refused by name
rather than ignored, so a client never gets silently different sampling than it asked for.

Other fields are ignored (``extra="ignore"``), as OpenAI's own optional ones must be: the official
client sends ``user``, ``metadata``, ``store``, ``service_tier`` and others that change nothing
generated. So the fields that would change the output -- vLLM's extras above all (guided
decoding, beam search, ``prompt_logprobs``...) -- are listed by name in ``REFUSED`` tables and
refused unless at their "off" value (before, a request with ``guided_choice`` got 200 and
unconstrained text).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from symbiosis.serving.sampling import MAX_LOGPROBS

#: A seed is a signed 64-bit integer, as OpenAI documents it (the ``n`` choices of a prompt draw from
#: seed, seed + 1, ..., which ``torch.Generator.manual_seed`` takes up to 2**64 - 1).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

#: Fields of vLLM's (and a few of OpenAI's) that change what is generated and that this server does
#: not implement, each with its "off" value: what the server does without it. A request may send
#: one only at that value, or null (or an empty list or object: asking for nothing).
REFUSED_EXTRAS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "prompt_logprobs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structural_tag": None,
    "structured_outputs": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "logits_processors": None,
    "truncate_prompt_tokens": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "return_tokens_as_token_ids": False,
    "vllm_xargs": None,
    "audio": None,
    "modalities": ["text"],
    "web_search_options": None,
}


def refuse_unless_off(data: Any, refused: dict[str, Any]) -> Any:
    """``data`` (a request body) unchanged, or a validation error naming the first field of
    ``refused`` it sets to something else than that field's off value (``ctx["param"]``: the
    field, for the error body's ``param``)."""
    if isinstance(data, dict):
        for name, off in refused.items():
            value = data.get(name)
            if value is not None and value != off and value not in ([], {}):
                hint = "leave it out" if off is None else f"leave it out or send {json.dumps(off)}"
                raise _unsupported(name, f"not supported by this server; {hint}")
    return data


def _unsupported(param: str, detail: str) -> PydanticCustomError:
    """The error of a field this server does not implement, naming it (``ctx["param"]``, as ``refuse_unless_off``)."""
    return PydanticCustomError("unsupported_parameter", "{detail}", {"param": param, "detail": detail})


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    #: Fields refused unless off (``refuse_unless_off``); each request kind adds its own.
    REFUSED: ClassVar[dict[str, Any]] = REFUSED_EXTRAS

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM extra; 0 or -1: off; over the vocabulary: all of it
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=16)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)  # vLLM extra; 1: off
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias, -100..100
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM extra; 0: off
    min_tokens: int = Field(default=0, ge=0)  # vLLM extra; 0: off
    user: str | None = None
    # OpenAI fields this server does not implement: accepted only at their "off" values, so a
    # request never gets silently different behaviour than it asked for.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    return_token_ids: bool = False  # vLLM extra: each choice also carries its token ids
    include_stop_str_in_output: bool = False  # vLLM extra: the text keeps the stop string that ended it

    @model_validator(mode="before")
    @classmethod
    def _refuse_extras(cls, data: Any) -> Any:
        return refuse_unless_off(data, cls.REFUSED)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        values = [value] if isinstance(value, str) else value
        if len(values) > 8 or any(not s or len(s) > 256 for s in values):
            raise ValueError("stop: up to 8 non-empty strings of at most 256 characters")
        return values

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100.0 <= bias <= 100.0 for bias in value.values()):
            raise ValueError("biases are between -100 and 100")
        if value and any(token < 0 for token in value):
            raise ValueError("token ids are not negative")
        return value

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> SamplingFields:
        """OpenAI's output-shaping fields, refused unless off like ``REFUSED``'s, and named the same
        way (the error body's ``param``; before, these errors named none)."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", "only {'type': 'text'} is supported (no JSON or schema mode)")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise _unsupported(name, "tool and function calling are not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise _unsupported(name, 'tool and function calling are not supported; leave it out or send "none"')
        return self

    def wanted_logprobs(self) -> int | None:
        """How many alternatives per token the request wants log-probabilities of (None: none)."""
        return None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingFields):
    REFUSED: ClassVar[dict[str, Any]] = {**REFUSED_EXTRAS, "add_special_tokens": True, "prompt_embeds": None}

    prompt: str | list[str] | list[int] | list[list[int]]  # texts, or token ids (one prompt or several)
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    echo: bool = False  # the prompt before the completion (and its log-probabilities with logprobs)
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(v, list) and not v for v in value)):
            raise ValueError("must not be an empty list or hold one")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 needs echo (a completion of no tokens echoes its prompt)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported (every generated choice is returned)")
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value, info: ValidationInfo):
        # As OpenAI: only an assistant message (one that called tools) may come without content, null or left out.
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of text parts)")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    # vLLM's chat extras; ``echo`` there puts the last message before the answer.
    REFUSED: ClassVar[dict[str, Any]] = {
        **REFUSED_EXTRAS,
        "echo": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "chat_template": None,
        "chat_template_kwargs": None,
        "documents": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true to use top_logprobs")
        return self

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages (through the chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for ``prompt``
    add_generation_prompt: bool = True  # for ``messages``

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int]
