"""CPU: the C kernels (csrc/, built with the system compiler on first use), the int4 x int8 VNNI GEMM, half steps
on two threads, the shared-memory all-reduce of TP ranks on one host, and process priority for the serving
processes.
"""
