"""The Triton backend's ``@triton.jit`` kernels, one module per op family; the wrappers one level
up choose a launch from :mod:`cpkv_backend_triton.tuning` and call them.

Variants are ``tl.constexpr`` parameters: an ``if`` or a conditional expression on one compiles
one side only, and ``triton.jit`` helpers are inlined, so a variant costs nothing at run time.

A kernel keeps its ``_<name>_kernel`` name: profiles and ``cpkv bench long``'s top-k share read
the kernels by these names. Importing a module here imports triton (the plugin imports none of
them until the backend is loaded).
"""
