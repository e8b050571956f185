"""The HTTP routes grouped by API: chat and completions, Responses, embeddings, operations (health, metrics,
admin) and the browser playground; http_app assembles them.
"""
