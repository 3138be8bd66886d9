"""Request and response bodies of the OpenAI-compatible API (pydantic 2).

Requests ignore unknown fields, because real clients (Open WebUI, editors)
send extras of their own. Fields that OpenAI defines but this server cannot
honour are declared anyway, so the routes can refuse them by name instead of
dropping them silently. Ranges are checked by ``SamplingParams``, the one
place that knows them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class _Request(BaseModel):
    # NaN and Infinity are valid to Python's JSON parser but never a sane sampling value.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def lone_surrogate(value: Any) -> str | None:
    """The path ("messages[0].content") of the first string holding a lone surrogate, or None.

    JSON may spell one (``"\\ud800"``) and Python's parser accepts it, but such a
    string is not Unicode: the tokenizer and every UTF-8 encoder (our own
    error answers included) fail on it.
    """
    parts = _surrogate_at(value)
    if parts is None:
        return None
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path or "body"


def _surrogate_at(value: Any) -> list[str | int] | None:
    """Where in ``value`` a bad string is, as keys and indexes ([] for ``value`` itself); None: nowhere.

    Only strings, lists and objects are visited, so a prompt of a million token ids costs one
    type check per id.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return []
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if _surrogate_at(key) is not None:  # named escaped: the path goes back to the client
                return [str(key).encode("utf-8", "backslashreplace").decode("utf-8")]
            if isinstance(item, (str, list, dict)) and (found := _surrogate_at(item)) is not None:
                return [key, *found]
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)) and (found := _surrogate_at(item)) is not None:
                return [i, *found]
    return None


class _Body(_Request):
    """A whole request body: its strings must be valid Unicode, wherever they are."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict) and (where := lone_surrogate(data)) is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "{param} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff escape)",
                {"param": where},
            )
        return data


class StreamOptions(_Request):
    include_usage: bool | None = None


class ChatMessage(_Request):
    role: str
    # Parts stay plain dicts so unsupported kinds (images, audio) can be refused with their index.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result: the call it answers


class SamplingFields(_Body):
    """The sampling fields chat and text completions share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in [-100, 100]"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = Field(
        default=None,
        description="keep generating past end-of-sequence (an extension vLLM and llama.cpp share; for benchmarks)",
    )
    response_format: dict[str, Any] | None = Field(
        default=None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}'
    )
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM's: output follows this JSON Schema"
    )
    guided_regex: str | None = Field(default=None, description="vLLM's: output matches this regex")
    guided_choice: list[str] | None = Field(default=None, description="vLLM's: output is one of these strings")
    guided_grammar: str | None = Field(default=None, description="vLLM's: output follows this Lark grammar")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, description="preferred over max_tokens when both are given")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: go on with the final assistant message (rendered open, no new turn), e.g. after "length".
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Known but unsupported: refused with a 400 naming the field when set.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses, the stateless subset: no stored responses to continue from."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(
        default=None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}'
    )
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None  # refused: nothing is stored to continue from
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted and ignored (effort hints)
    truncation: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for text completions
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None


# -- responses ----------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's think block (vLLM's and DeepSeek's field)
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 bytes")


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = Field(default=None, description="the context length, in tokens (as vLLM)")
    loaded: bool = Field(
        default=False, description="held by the engine now; any listed model answers, loaded on demand"
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
