"""The OpenAI wire contract: request and response types, their decoding, the fields this
frontend refuses, the limits it enforces and its error bodies. Imports nothing else of the
frontend.
"""
