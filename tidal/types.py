"""Native request-level types shared by the engine, scheduler, runner and front ends.

The HTTP layer and the CLI translate their inputs into these; nothing below the engine sees JSON.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from tidal.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop. Defaults reproduce greedy decoding of 16 tokens."""

    max_tokens: int = 16
    temperature: float = 0.0          # 0 means greedy (argmax)
    top_p: float = 1.0                # nucleus mass kept, (0, 1]
    top_k: int = 0                    # 0 or -1 disables; otherwise keep the k most likely tokens
    min_p: float = 0.0                # drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0   # HF semantics: over prompt + generated ids
    presence_penalty: float = 0.0     # OpenAI semantics: over generated ids only
    frequency_penalty: float = 0.0    # OpenAI semantics: over generated ids only
    seed: Optional[int] = None        # per-request generator; same seed + same params -> same tokens
    stop: list[str] = field(default_factory=list)           # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation
    ignore_eos: bool = False          # keep generating past eos (benchmarks)
    logprobs: Optional[int] = None    # None: no logprobs; n >= 0: chosen token's + top-n alternatives
    skip_special_tokens: bool = True  # in the returned text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the field when a value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---------------------------------------------------------------------------------------------------
# Engine-side request state and the scheduler -> runner -> scheduler contract.


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV pages
    RUNNING = "running"      # holds KV pages; prefilling (chunk by chunk) or decoding
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, under the model's raw distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # (token id, logprob), most likely first


@dataclass
class Request:
    """One generation request as the engine tracks it. Only the scheduler and engine mutate it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)   # KV pages, in position order
    num_computed: int = 0            # tokens (prompt + output) whose K/V are in the cache
    state_slot: Optional[int] = None # recurrent-state slot while running (models with linear attention)
    num_cached_prefix: int = 0       # prompt tokens reused from the prefix cache
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    generator: Optional[object] = None    # torch.Generator for seeded sampling
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class ScheduledSeq:
    request: Request
    start: int        # position of the first token computed this step (== request.num_computed)
    num_tokens: int   # tokens computed this step (a prefill chunk, or 1 when decoding)
    sample: bool      # this step reaches the end of the known tokens, so a new token is sampled


@dataclass
class ScheduledBatch:
    """What the runner computes in one forward. The scheduler has already allocated every KV page
    these tokens need; the runner never allocates or frees pages."""

    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class StepOutput:
    """Runner -> scheduler: the sampled token (and its logprobs) for each sequence that sampled."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob]


@dataclass
class RequestOutput:
    """Engine -> front ends, once per step for each request that made progress."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    stop_reason: Optional[object] = None   # the stop string or token id that ended it, if any
