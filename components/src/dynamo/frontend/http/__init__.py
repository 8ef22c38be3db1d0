"""The HTTP stage: listener, routes, auth, admission, OpenAPI, metrics, and one request carried
from its prepared form to the response it writes.
"""
