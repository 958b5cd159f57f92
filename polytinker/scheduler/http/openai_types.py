"""The OpenAI API's request bodies, decoded at the edge (pydantic; unknown fields ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of newer API versions are ignored, as by vLLM


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    model: str = Field(min_length=1, max_length=1000)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): -1 or 0 is none
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # extension (vLLM's)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


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
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


__all__ = ["ChatRequest", "CompletionRequest", "ContentPart", "Message", "SamplingFields", "Tool", "ToolCall"]
