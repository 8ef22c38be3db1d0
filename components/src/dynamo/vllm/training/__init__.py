"""Training draft models for speculative decoding."""
