"""Ray Serve: the ingress (FastAPI), the tokenizer / chat-template deployment, the model server that drives an
engine client, the builder that turns cluster.yaml into an application, auth, metrics and request guards.
"""
