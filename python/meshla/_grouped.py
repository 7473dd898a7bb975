"""The grouped GEMM's words shared by both front ends."""

# What grouped_matmul (jax.lax.ragged_dot's and torch._grouped_mm's layout, the core's
# WeightLayout.in_out) calls the operands that the core's grouped checks name.
RAGGED_NAMES = {"m_splits": "group_sizes", "x": "lhs", "weight": "rhs", "y": "out"}
