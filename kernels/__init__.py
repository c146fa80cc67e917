"""aepo_kernels: fused AEPO loss kernels (import name ``aepo_kernels``; folder ``kernels/``)."""
