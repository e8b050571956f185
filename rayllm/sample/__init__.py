"""Sampling on the driver rank: per-request sampling tensors, the sampler's pure functions, logprobs, and
grammar-constrained decoding (guided, with its compiler in a child process).
"""
