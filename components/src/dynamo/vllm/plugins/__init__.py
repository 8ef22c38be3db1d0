"""vLLM plugins that repair vLLM-CPU behaviour (loaded through the `vllm.general_plugins` entry
point).
"""
