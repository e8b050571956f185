"""Tensor-parallel communication: the process group and the all-reduce (NCCL, gloo, or DeepSpeed's shared memory
on CPU).
"""
