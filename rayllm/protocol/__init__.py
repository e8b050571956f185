"""The OpenAI surface: request and response models, validation, SSE formatting, tools, structured output and the
messages between the ingress, tokenizer and model deployments (io_struct). Imports neither torch nor Ray.
"""
