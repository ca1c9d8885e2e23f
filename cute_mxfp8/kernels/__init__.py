"""CuTe DSL kernels (SM90 / SM100).  Nothing here imports torch or the DSL at module scope: the DSL is imported
lazily by each kernel module, so ``import cute_mxfp8`` works on machines without CUDA."""
