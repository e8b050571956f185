"""Model families beyond the Llama decoder (model_parallel/llama.py), one small file each, built from
the shared layers in parallel.py and layers.py and listed in model_parallel/registry.py."""
