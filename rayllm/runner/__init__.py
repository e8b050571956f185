"""Where sequences become tensors: the model runner (ids, positions, slot mapping, attention metadata), its
input buffers, CUDA graph capture and replay, and the paged KV cache's sizing and layout.
"""
