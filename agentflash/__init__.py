"""agentflash: an in-process runtime that makes LLM agent loops fast."""

__version__ = "0.1.0"
