"""The Python API: `tidal.LLM(model).generate(...)` and `.chat(...)`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from tidal.engine.engine import Engine
from tidal.errors import RequestError
from tidal.types import SamplingParams, TokenLogprob

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    """One finished generation."""

    text: str
    token_ids: list[int]                 # generated ids only (an eos that ended it is included)
    finish_reason: Optional[str]         # "stop" | "length" | "abort"
    prompt_token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None
    stop_reason: object = None           # the stop string or token id that ended it, if any
    num_cached_tokens: int = 0
    extras: dict = field(default_factory=dict)


class LLM:
    """Load a model once, then generate from prompts or chat messages.

    `model` is a local Hugging Face directory, a Hub id (downloaded when online), or None for the
    built-in demo model. Options mirror the CLI flags (`max_model_len`, `max_running`, ...).
    """

    def __init__(self, model: Optional[str] = None, device: str = "auto", dtype: str = "auto", **options):
        if model is None:
            from tidal.weights.demo import demo_model_path
            model = str(demo_model_path())
        self.engine = Engine(model, device=device, dtype=dtype, **options)
        self.tokenizer = self.engine.tokenizer

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None
                 ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order. A prompt is text or a list of token ids."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        ids = [self._encode(p) for p in batch]
        params = sampling_params or SamplingParams()
        results = self.engine.generate(ids, list(params) if isinstance(params, (list, tuple)) else params)
        return [CompletionOutput(text, list(r.output_ids), r.finish_reason, list(r.prompt_ids),
                                 list(r.logprobs) if r.params.logprobs is not None else None,
                                 r.stop_reason, r.num_cached_prefix) for r, text in results]

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
             tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
             **template_kwargs) -> CompletionOutput:
        """Render the chat template, generate, and return the assistant's reply."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot chat")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **template_kwargs)
        return self.generate([ids], sampling_params)[0]
