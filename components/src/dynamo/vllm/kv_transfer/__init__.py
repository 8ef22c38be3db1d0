"""KV handed from prefill to decode workers on CPU: the disk connector, the shared transfer
directory, its janitor, the layout check and the storage check.
"""
