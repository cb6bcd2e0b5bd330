"""kvstore: a tiered KV-cache store for disaggregated LLM serving."""

__version__ = "0.1.0"
