"""The served engine: the `AsyncLLM` behind the worker's backend seam, request handlers,
conversion between wire types and vLLM's, stats, metrics and the KV and load publishers.
"""
