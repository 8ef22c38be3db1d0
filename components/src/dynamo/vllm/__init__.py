"""The vLLM worker: `python -m dynamo.vllm`."""
