"""`tidal chat` in a terminal: answers each line, keeps the conversation, quits on end of input."""
import subprocess
import sys


def test_chat_answers_each_line_and_exits_cleanly():
    proc = subprocess.run([sys.executable, "-m", "tidal", "--quiet", "chat", "--max-tokens", "8", "--device", "cpu"],
                          input="def add(a, b):\n/reset\nimport os\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # One prompt per input line, plus the final one that meets end of input.
    assert proc.stdout.count("> ") == 4
    assert "/reset" in proc.stderr  # the banner explains the commands
