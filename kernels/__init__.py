"""agentflash.kernels: attention and speculative-decoding kernels over plain tensors.

Each kernel has a torch reference (reference.py, what runs on CPU) and, where it pays, a Triton
version for CUDA; dispatch.py picks one. Kernels know nothing of sequences or caches beyond tensors.
"""
