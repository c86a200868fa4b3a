"""Request bodies of the HTTP APIs, as pydantic models (the only place pydantic is used).

Unknown fields are accepted and ignored, as OpenAI and Anthropic do, so newer clients keep working.
Range constraints live here so that a bad value is rejected with a 400 that names the field; the
handlers turn these models into native SamplingParams and message dicts at once.
Response bodies are built as plain dicts by the handlers: they are ours to get right, and building
them without a validation layer keeps the streaming path cheap.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Open(BaseModel):
    """A block whose type decides which other fields matter; the handler reads the rest from
    `model_extra` (raw JSON values)."""

    model_config = ConfigDict(extra="allow")
    type: Optional[str] = None


# -- sampling fields shared by the OpenAI-style endpoints, plus the usual engine extensions -------------
class SamplingFields(Lenient):
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    user: Optional[str] = None


class StreamOptions(Lenient):
    include_usage: bool = False


# -- OpenAI chat completions ----------------------------------------------------------------------------
class FunctionDefinition(Lenient):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolCallFunction(Lenient):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ChatToolCall(Lenient):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[Open]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ChatToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class ChatCompletionRequest(SamplingFields):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


# -- OpenAI legacy completions --------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    model: Optional[str] = None
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=1, description="only best_of=1 is supported")


# -- OpenAI responses -----------------------------------------------------------------------------------
class ResponsesRequest(Lenient):
    model: Optional[str] = None
    input: Union[str, list[Open]]
    instructions: Optional[str] = None
    tools: Optional[list[Open]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], Open]] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: Optional[Open] = None
    text: Optional[Open] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None


# -- Anthropic messages ---------------------------------------------------------------------------------
class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: Union[str, list[Open]]


class AnthropicTool(Lenient):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    type: Optional[str] = None


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(Lenient):
    type: str                        # enabled | disabled | adaptive | between_tools | ...
    budget_tokens: Optional[int] = None


class CountTokensRequest(Lenient):
    model: Optional[str] = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[Open]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[Open] = None    # {"effort": ..., "format": {"type": "json_schema", "schema": ...}}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[dict[str, Any]] = None
