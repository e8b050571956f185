"""The executor protocol and its implementations (local, Ray actors per TP rank) and the Worker that each rank
runs: process group, model, weights, KV cache, model runner.
"""
