"""Tidal: serve Mixture-of-Experts LLMs larger than your GPU on one personal machine, exactly."""
from tidal.errors import TidalError
from tidal.types import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TidalError", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the engine; import it on first use so `import tidal` stays light.
    if name == "LLM":
        from tidal.llm import LLM
        return LLM
    raise AttributeError(name)
