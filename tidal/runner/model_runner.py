"""Runs one scheduled batch through the model and samples the next tokens."""
from __future__ import annotations

from typing import Optional

import torch

from tidal.kvcache.page_pool import KVPool
from tidal.kvcache.state_pool import StatePool
from tidal.layers.context import ForwardContext, SeqSlice, forward_context
from tidal.runner.sampler import Sampler
from tidal.types import ScheduledBatch, StepOutput, TokenLogprob


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, device: torch.device, state_pool: Optional[StatePool] = None):
        self.model, self.kv_pool, self.device = model, kv_pool, device
        self.state_pool = state_pool    # recurrent state of linear-attention layers, or None
        self.page_size = kv_pool.page_size
        self.sampler = Sampler()

    def _kv_slots(self, pages: list[int], ctx_len: int) -> torch.Tensor:
        pos = torch.arange(ctx_len)
        return torch.tensor(pages, dtype=torch.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Compute the batch's hidden states [T, hidden]; also return the rows to sample from."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        sample_rows: list[int] = []
        for s in batch.seqs:
            req, end = s.request, s.start + s.num_tokens
            input_ids.extend(req.all_ids[s.start:end])
            positions.append(torch.arange(s.start, end))
            slots = self._kv_slots(req.pages, end)                      # [ctx]
            slot_mapping.append(slots[s.start:end])
            q_start = len(input_ids) - s.num_tokens
            seqs.append(SeqSlice(q_start, s.num_tokens, end, slots.to(self.device, non_blocking=True),
                                 req.state_slot))
            if s.sample:
                sample_rows.append(q_start + s.num_tokens - 1)
        ctx = ForwardContext(
            seqs=seqs,
            slot_mapping=torch.cat(slot_mapping).to(self.device),
            kv_cache=self.kv_pool,
            state_cache=self.state_pool,
            is_decode=all(s.num_tokens == 1 for s in batch.seqs),
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.cat(positions).to(self.device)
        with forward_context(ctx):
            hidden = self.model(ids_t, pos_t)                               # [T, hidden]
        return hidden, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        hidden, sample_rows = self.forward(batch)
        sampled = [s for s in batch.seqs if s.sample]
        if not sampled:
            return StepOutput({}, {})
        logits = self.model.compute_logits(hidden[sample_rows])             # [B, V] float32
        reqs = [s.request for s in sampled]
        out = self.sampler(logits, [r.params for r in reqs], [r.prompt_ids for r in reqs],
                           [r.output_ids for r in reqs], [r.generator for r in reqs])
        token_ids = out.token_ids.tolist()
        result = StepOutput({r.request_id: t for r, t in zip(reqs, token_ids)}, {})
        if out.logprobs is not None:
            lps = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in reqs]
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in reqs]
            for i, r in enumerate(reqs):
                if r.params.logprobs is not None:
                    n = r.params.logprobs
                    result.logprobs[r.request_id] = TokenLogprob(
                        token_ids[i], lps[i], list(zip(top_ids[i][:n], top_lps[i][:n])))
        return result
