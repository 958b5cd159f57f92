"""The OpenAI API's request bodies, decoded at the edge (pydantic; unknown fields ignored).

Strict: a field takes its own JSON type only (no "3" or true for a count, no number for a
string), every float is finite, and every list and count is bounded, so that a hostile body is a
400 naming the field before anything is built from it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_INT32 = (1 << 31) - 1


class Body(BaseModel):
    # Fields of newer API versions are ignored, as by vLLM.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    model: str = Field(min_length=1, max_length=1000)
    n: int = Field(1, ge=1, le=MAX_INT32)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # extension (vLLM's): -1 or 0 is none
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = Field(None, max_length=1000)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(None, max_length=64)  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)


class ContentPart(Body):
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str = "{}"


class ToolCall(Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, max_length=1 << 24)
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=1 << 24)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=-MAX_INT32, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=5)


__all__ = ["ChatRequest", "CompletionRequest", "ContentPart", "Message", "SamplingFields", "Tool", "ToolCall"]
