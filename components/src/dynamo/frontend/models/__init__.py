"""The served models: the registry of model cards and each model's pipeline, kept in sync with
the cards workers register, retried when one fails to load.
"""
