"""Checkpoints to parameters: one architecture record read from GGUF or config.json, weights streamed into each
parameter's own weight_loader, and where the default and named models are found (model_files).
"""
