"""Tensor-parallel communication: the process group and the all-reduce (NCCL on GPU; on CPU gloo, or the
shared-memory kernel of rayllm.platforms.cpu for ranks on one host).
"""
