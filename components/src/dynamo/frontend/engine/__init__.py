"""The engine side: the client of a model's workers (routing, request legs, streams, deadlines,
migration), disaggregated prefill and beam search.
"""
