"""The polar decomposition and SVD of a square matrix (the tall routines' n x n R) by QDWH.

gesvd, torch's SVD on CUDA, bidiagonalises one column at a time: memory-bound, 2.3 s for a
4096 x 4096 float64 R on an H200, where the whole tall SVD's other stages take a fraction of that
(NOTES 87, 94). QDWH (Nakatsukasa, Bai and Gygi, "Optimizing Halley's iteration for computing the
matrix polar decomposition", SIAM J. Matrix Anal. Appl. 31(5), 2010) reaches the polar factor U
in about six QR or Cholesky iterations of GEMM-rich work; the SVD follows from the eigenvectors
of H (Nakatsukasa and Higham, SIAM J. Sci. Comput. 35(3), 2013). Where QDWH's U is not
orthonormal, or U H is not R to working accuracy (R numerically singular, zero, or not finite),
gesvd's answer is returned instead: slower, but as accurate as before.
"""

from __future__ import annotations

import math

import torch


def _weights(lower: float, eps: float) -> list[tuple[float, float, float]]:
    """QDWH's (a, b, c) for each iteration, from a lower bound on the scaled matrix's smallest
    singular value (the paper's equations 3.3-3.5 and its l update), until the bound is within
    10 eps of 1; then one plain Halley step (3, 1, 3), which the converged values pass unchanged
    and the last stragglers need."""
    weights = []
    while 1.0 - lower > 10.0 * eps:
        gamma = (4.0 * (1.0 - lower**2) / lower**4) ** (1.0 / 3.0)
        root = math.sqrt(1.0 + gamma)
        a = root + 0.5 * math.sqrt(8.0 - 4.0 * gamma + 8.0 * (2.0 - lower**2)
                                   / (lower**2 * root))
        b = (a - 1.0) ** 2 / 4.0
        c = a + b - 1.0
        weights.append((a, b, c))
        lower = min(1.0, lower * (a + b * lower**2) / (1.0 + c * lower**2))
    return [*weights, (3.0, 1.0, 3.0)]


def _qdwh(r: torch.Tensor) -> torch.Tensor:
    """The QDWH iterate for R's polar factor, then one Newton-Schulz step (as jax's QDWH ends),
    which makes an iterate that is close orthonormal to working accuracy (unchecked)."""
    n = r.shape[-1]
    eps = torch.finfo(r.dtype).eps
    eye = torch.eye(n, dtype=r.dtype, device=r.device)
    # ||R||_F bounds the largest singular value; with it the smallest of x is at least
    # 1 / (cond(R) sqrt(n)), so eps / sqrt(n) bounds it wherever R is not numerically singular.
    x = r / torch.linalg.matrix_norm(r)
    for a, b, c in _weights(eps / math.sqrt(n), eps):
        if c > 100.0:  # the QR form: stable for any c (the Cholesky form needs c small)
            q, _ = torch.linalg.qr(torch.cat([math.sqrt(c) * x, eye]))
            x = (b / c) * x + ((a - b / c) / math.sqrt(c)) * (q[:n] @ q[n:].mH)
        else:  # x (I + c xᴴx)⁻¹ through its Cholesky factor: a third of the QR's work
            # (cholesky_ex: a NaN x, from a zero R, runs on to the check instead of raising)
            factor, _ = torch.linalg.cholesky_ex(eye + c * (x.mH @ x))
            x = (b / c) * x + (a - b / c) * torch.cholesky_solve(x.mH, factor).mH
    return 1.5 * x - 0.5 * (x @ (x.mH @ x))


def _accepted(u: torch.Tensor, h: torch.Tensor, r: torch.Tensor) -> bool:
    """Whether U and H = Uᴴ R (before symmetrizing) are R's polar factors to working accuracy,
    both to a tolerance of 10 sqrt(n) eps: UᴴU = I entrywise (a converged iterate misses by a few
    eps; on a numerically singular R the directions of its smallest singular values may not
    converge, leaving U 1e5 eps off), and H Hermitian relative to ||R||_F, which bounds
    ||R - U H_sym|| (an iterate can be orthonormal and still miss R by 1e5 eps). NaN fails."""
    n = r.shape[-1]
    tolerance = 10 * math.sqrt(n) * torch.finfo(r.dtype).eps
    eye = torch.eye(n, dtype=u.dtype, device=u.device)
    orthonormal = (u.mH @ u - eye).abs().max() <= tolerance
    skew = torch.linalg.matrix_norm(h - h.mH) / 2
    hermitian = skew <= tolerance * torch.linalg.matrix_norm(r)
    return bool(orthonormal & hermitian)  # one wait for the device


def polar(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, H), R = U H, U unitary and H Hermitian positive semi-definite."""
    u = _qdwh(r)
    h = u.mH @ r
    if not _accepted(u, h, r):
        # gesvd: CUDA's default, gesvdj, misses float64 values by 1e-13 relative (NOTES 106)
        u_r, s, vh = torch.linalg.svd(r, driver="gesvd" if r.is_cuda else None)
        return u_r @ vh, (vh.mH * s.to(vh.dtype)) @ vh
    return u, (h + h.mH) / 2


def svd(r: torch.Tensor, compute_uv: bool = True):
    """R's SVD, as torch.linalg.svd(r) (U, s descending, Vᴴ), or s alone: from the polar
    decomposition, H = V diag(s) Vᴴ and U = U_p V. H's eigensolver runs in double precision:
    torch's on CUDA misses float32 eigenvalues by 500 eps (NOTES 106)."""
    u_p, h = polar(r)
    wide = h.to(torch.promote_types(h.dtype, torch.float64))
    if not compute_uv:
        return torch.linalg.eigvalsh(wide).flip(-1).clamp(min=0).to(r.real.dtype)
    values, v = torch.linalg.eigh(wide)
    v = v.flip(-1).to(r.dtype)
    return u_p @ v, values.flip(-1).clamp(min=0).to(r.real.dtype), v.mH.resolve_conj()
