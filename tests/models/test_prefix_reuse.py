"""A second request sharing a prefix reuses its KV pages and still computes the same tokens."""
from tests.models.tiny import make_reference, reference_greedy, save
from tidal.engine.engine import Engine
from tidal.types import SamplingParams


def test_multi_turn_reuses_prefix_and_matches_reference(tmp_path):
    ref = make_reference("qwen3_moe", seed=7)
    path = save(ref, tmp_path / "m")
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False, page_size=4)
    turn1 = list(range(3, 30))
    (r1, _), = engine.generate([turn1], SamplingParams(max_tokens=6, ignore_eos=True))
    turn2 = turn1 + r1.output_ids + [40, 41, 42, 43, 44]
    (r2, _), = engine.generate([turn2], SamplingParams(max_tokens=12, ignore_eos=True))
    # Everything computed in turn 1 (prompt + 5 of 6 outputs), in full pages, is reused.
    assert r2.num_cached_prefix == (len(turn1) + 5) // 4 * 4
    assert r2.output_ids == reference_greedy(ref, turn2, 12)


def test_cache_pressure_evicts_instead_of_failing(tmp_path):
    ref = make_reference("olmoe", seed=8)
    path = save(ref, tmp_path / "m")
    # Room for two requests' worth of pages only; ten distinct prompts pass through.
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False, page_size=4,
                    max_model_len=64, kv_cache_tokens=128, max_running=2)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(30)] for i in range(10)]
    results = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for ids, (req, _) in zip(prompts[:3], results[:3]):
        assert req.output_ids == reference_greedy(ref, ids, 8)
    assert all(r.finish_reason == "length" for r, _ in results)
