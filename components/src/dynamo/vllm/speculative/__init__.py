"""Speculative decoding: config sources (TensorRT-LLM, speculators checkpoints) resolved into
vLLM's, the measured profile and its schedule, the monitor, and K adapted online by a vLLM
scheduler.
"""
