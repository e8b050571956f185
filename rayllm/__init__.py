"""rayllm: an OpenAI-compatible LLM server on Ray Serve with its own tensor-parallel engine.

Flow, top to bottom (each folder imports only the ones below it; .importlinter enforces it):
serve (Ray Serve deployments and routes) -> protocol (OpenAI models, no torch, no Ray) and engine.client ->
engine (torch-free core: scheduler, block manager, sequences, step messages) -> executor (workers) ->
runner (sequences to tensors, KV cache, CUDA graphs) -> models / layers / attention / sample / lora /
quant / loader -> distributed, platforms, common.
"""
