"""svdq_kernels: CuTe-DSL kernel sources (build time only; imports the DSL)."""
