"""The CPU fast path: what `Engine` does to its models to run fast on the machine it is on.

One entry, `engine.cpu.fastpath.prepare`: a list of transformations, each with the condition
it applies under (CPU and dtype, the CPU's instruction sets, whether agentflash's CPU kernels
build, whether a compile is wanted). The rest of this package is what they install:
- forward.py: the decode/verify forward and the drafter's block forward as modules that run on
  the CPU kernels (TargetStep, DraftStep), and how a step calls them (DecodeForward,
  DraftForward); compiled.py: the same compiled ahead of time (AOTInductor), cached on disk;
- attention.py: attention through the CPU kernel over the paged pool in place;
- kernel_linear.py, packed.py, quantized.py: linears on the CPU kernels (bf16), oneDNN-packed
  weights, int8 weights.
"""
