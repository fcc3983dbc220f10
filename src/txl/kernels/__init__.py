"""Kernels: the fast paths of named operations and the policy that chooses them (``txl.kernels.backends``), the
native C kernels (``txl.kernels.native``) and the run-time choices of precision and matmul route
(``txl.kernels.runtime``). Imports only ``txl.util``; the model layer above calls these, never the reverse."""
