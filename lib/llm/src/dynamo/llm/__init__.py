"""LLM layer: wire protocols, model card, embedded models, KV-aware routing."""
