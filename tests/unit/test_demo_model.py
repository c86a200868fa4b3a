"""The built-in demo model: trained on Python's standard library, it must continue Python code."""
import codeop

import pytest

from tidal.weights.demo import PACKAGED, demo_model_path


@pytest.fixture(scope="module")
def llm():
    import tidal

    assert demo_model_path() == PACKAGED, "the trained demo checkpoint is missing from the package"
    return tidal.LLM(device="cpu", dtype="float32", progress=False)


# Prompts end mid-line, as a user types them: the model was trained on whole files, where a
# newline is usually merged with the next line's indentation into one token.
@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "import os", "class Stack:"])
def test_greedy_continuation_is_python(llm, prompt):
    import tidal

    out = llm.generate([prompt], tidal.SamplingParams(max_tokens=48, repetition_penalty=1.3))[0]
    text = prompt + out.text
    complete_lines = text[: text.rfind("\n") + 1]
    assert len(complete_lines) > len(prompt), "no complete line was generated"
    # compile_command returns None for valid-but-unfinished code and raises SyntaxError otherwise.
    codeop.compile_command(complete_lines, symbol="exec")
    assert any(ch.isalpha() for ch in out.text)


def test_chat_template_and_eos(llm):
    assert llm.engine.eos_token_ids  # <|endoftext|> and <|im_end|>
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "sort a list"}], tokenize=True)
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
