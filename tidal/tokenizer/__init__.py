"""Text side of serving: the model's tokenizer (tokenizer.json + its config files), chat templates,
streaming detokenization and stop strings. Everything here runs on the CPU and sees no tensors."""
from tidal.tokenizer.chat_template import load_chat_template, render_chat_template
from tidal.tokenizer.detokenizer import IncrementalDetokenizer
from tidal.tokenizer.stop import StopStringMatcher
from tidal.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "StopStringMatcher", "render_chat_template",
           "load_chat_template"]
