"""Chunked prefill computes the same function as one-shot prefill, for every family (float32, CPU)."""
import pytest

from tests.models.test_parity import PROMPTS
from tests.models.tiny import FAMILIES, make_reference, reference_greedy, save
from tidal.engine.engine import Engine
from tidal.types import SamplingParams


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_reference(family, tmp_path):
    ref = make_reference(family, seed=11)
    path = save(ref, tmp_path / family)
    # 5-token forwards: every prompt is split into chunks that straddle KV pages of 4 tokens, and the
    # three prompts' chunks interleave with each other's decode steps.
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False, page_size=4, max_batch_tokens=5,
                    prefix_cache=False)
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
    whole = Engine(str(path), device="cpu", dtype="float32", progress=False, prefix_cache=False)
    want = whole.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
    for ids, (got, _), (exp, _) in zip(PROMPTS, results, want):
        assert got.output_ids == reference_greedy(ref, ids, 12) == exp.output_ids
        for a, b in zip(got.logprobs, exp.logprobs):   # same distribution at every step, to fp32 rounding
            assert abs(a.logprob - b.logprob) < 1e-4
