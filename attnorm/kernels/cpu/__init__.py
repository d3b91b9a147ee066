"""The native CPU backend: C kernels (``csrc/``), their build and cache (:mod:`.build`) and the
contract's functions calling them (:mod:`.native`)."""
