"""The request side: chat templating, template kwargs, tools and structured output checked,
sampling fields checked, prompts tokenized and truncated.
"""
