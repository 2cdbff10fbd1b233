"""Test and benchmark helpers of svdq_loader (imported on demand, never by ``import svdq_loader``).

* `reference`: the float64 reference of the GEMM, the NVFP4 codec, the
  blocked scale layout, random problems;
* `quantize_ref`: the exact (bit-for-bit) rules of ``quantize_act``;
* `bench`: the ``svdq-aot bench`` benchmark.
"""
