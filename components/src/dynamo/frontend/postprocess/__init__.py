"""The response side: detokenizing, stop strings, choices, and the chat, completion and
Responses formatters.
"""
