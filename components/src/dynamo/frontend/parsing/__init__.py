"""Reading the model's text back into OpenAI fields: reasoning and tool-call parsers. The one
place the frontend imports vLLM.
"""
