"""Random test matrices and the error tolerance shared by the solver checks (no JAX here, so
the one-process-per-GPU checks do not start JAX in every rank)."""

import numpy as np
import torch

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
EPS = {np.float32: 1.2e-7, np.complex64: 1.2e-7, np.float64: 2.3e-16, np.complex128: 2.3e-16}
TORCH_DTYPES = {np.float32: torch.float32, np.float64: torch.float64,
                np.complex64: torch.complex64, np.complex128: torch.complex128}


def tolerance(dtype, n):
    return 30 * EPS[dtype] * max(n, 16) ** 0.5


def random_spd(n, dtype, rng, condition=None, device="cpu"):
    """Q diag(spectrum) Qᴴ with Q from the QR of a Gaussian matrix (in double precision on
    `device`: the host takes minutes for the largest checks' n)."""
    m = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        m = m + 1j * rng.standard_normal((n, n))
    q, _ = torch.linalg.qr(torch.from_numpy(m).to(device))
    spectrum = torch.from_numpy(np.geomspace(1.0, 1.0 / condition, n) if condition
                                else rng.uniform(0.5, 2.0, n)).to(device)
    return ((q * spectrum) @ q.conj().T).cpu().numpy().astype(dtype)


def random_symmetric(n, dtype, rng):
    m = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        m = m + 1j * rng.standard_normal((n, n))
    return ((m + m.conj().T) / 2).astype(dtype)


def random_general(n, dtype, rng, singular_column=None, columns=None):
    """An n x n Gaussian matrix (not symmetric: the LU solve's pivoting is exercised), or
    n x ``columns``; with ``singular_column`` that column zero, which gives an exactly zero pivot
    whatever the pivoting."""
    shape = (n, n if columns is None else columns)
    m = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        m = m + 1j * rng.standard_normal(shape)
    if singular_column is not None:
        m[:, singular_column] = 0
    return m.astype(dtype)


def random_conditioned(n, dtype, rng, device="cpu"):
    """U diag(s) Vᴴ, n x n, U and V from QRs of Gaussian matrices (in double precision on
    `device`, as random_spd's) and s in [0.5, 2]: a square general matrix of condition at most 4
    (a Gaussian one's grows with n), for checks whose error bounds carry the condition number
    (gradients through the normal equations)."""
    def orthonormal():
        m = rng.standard_normal((n, n))
        if np.issubdtype(dtype, np.complexfloating):
            m = m + 1j * rng.standard_normal((n, n))
        return torch.linalg.qr(torch.from_numpy(m).to(device))[0]

    u, v = orthonormal(), orthonormal()
    s = torch.from_numpy(rng.uniform(0.5, 2.0, n)).to(device)
    return ((u * s) @ v.conj().T).cpu().numpy().astype(dtype)
