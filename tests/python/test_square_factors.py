"""The tall routines' n x n R stage (polar decomposition and SVD by QDWH, the SVD's answer where
QDWH's is not R's to working accuracy) in both frameworks, against numpy's SVD in complex128:
matrices QDWH takes (well conditioned, condition 1e5, and 1e12 in double precision), ones it
hands to the SVD (zero, not finite), and numerically singular ones with graded spectra, on which
an iterate can look orthonormal and still miss R by 1e5 eps (a review found that)."""

import jax
import numpy as np
import pytest
import torch

from meshla.jax import linalg as jax_linalg
from meshla.torch import _square

N = 48
DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
EPS = {np.float32: 2.0**-23, np.complex64: 2.0**-23, np.float64: 2.0**-52,
       np.complex128: 2.0**-52}


def matrix(dtype, values, seed):
    """U diag(values) Vᴴ with random unitary U and V (values None: a Gaussian matrix)."""
    rng = np.random.default_rng(seed)

    def draw():
        x = rng.standard_normal((N, N))
        return x + 1j * rng.standard_normal((N, N)) if np.iscomplexobj(dtype(0)) else x

    if values is None:
        return draw().astype(dtype)
    u, v = np.linalg.qr(draw())[0], np.linalg.qr(draw())[0]
    return ((u * values) @ v.conj().T).astype(dtype)


def single(dtype):
    return dtype in (np.float32, np.complex64)


TAKEN = {"gaussian": None, "condition 1e5": np.logspace(0, -5, N)}
HANDED_ON = {"zero": np.zeros(N)}


def cases(dtype):
    """(name, R, whether QDWH's U must be the answer: True, False, or None where either may be,
    the answer right either way)."""
    out = [(name, matrix(dtype, values, seed), True)
           for seed, (name, values) in enumerate(TAKEN.items())]
    ill = np.logspace(0, -12, N)  # within double precision's reach, beyond single's
    out.append(("condition 1e12", matrix(dtype, ill, 7), None if single(dtype) else True))
    out += [(name, matrix(dtype, values, 8 + seed), False)
            for seed, (name, values) in enumerate(HANDED_ON.items())]
    out.append(("rank 40", matrix(dtype, np.r_[np.ones(N - 8), np.zeros(8)], 12), None))
    graded = [-8, -14] if single(dtype) else [-18.5]
    out += [(f"graded to 1e{low} #{seed}", matrix(dtype, np.logspace(0, low, N), 20 + seed), None)
            for low in graded for seed in range(6)]
    return out


def check(r, u, h, u_svd, s, vh, values_only, dtype):
    """Against numpy: s; U orthonormal, U diag(s) Vᴴ = R; the polar U H = R, H Hermitian
    positive semi-definite and, where R is nonsingular, U and H numpy's own (unique)."""
    eps = EPS[dtype]
    scale = max(np.linalg.norm(r), 1.0)
    want = np.linalg.svd(r.astype(np.complex128), compute_uv=False)
    eye = np.eye(N)
    assert np.abs(s - want).max() <= 50 * eps * scale
    assert np.abs(values_only - want).max() <= 50 * eps * scale
    assert np.all(np.diff(s) <= 0) and np.all(s >= 0)
    # QDWH's U is taken where orthonormal to 10 sqrt(n) eps entrywise; the SVD's is it times
    # H's eigenvectors (numpy's gesvd gives a few eps)
    bound = 10 * np.sqrt(N) * eps
    assert np.abs(u.conj().T @ u - eye).max() <= bound
    assert np.abs(u_svd.conj().T @ u_svd - eye).max() <= 2 * bound
    assert np.linalg.norm((u_svd * s) @ vh - r) <= 50 * eps * scale
    assert np.linalg.norm(u @ h - r) <= 50 * eps * scale
    assert np.linalg.norm(h - h.conj().T) <= 50 * eps * scale
    assert np.linalg.eigvalsh(h.astype(np.complex128)).min() >= -50 * eps * scale
    if want[-1] > 1e3 * eps * want[0]:  # nonsingular: the polar factors are unique
        w_u, w_s, w_vh = np.linalg.svd(r.astype(np.complex128))
        assert np.linalg.norm(u - w_u @ w_vh) <= 100 * eps * want[0] / want[-1] * N
        assert np.linalg.norm(h - (w_vh.conj().T * w_s) @ w_vh) <= 50 * eps * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_square_polar_and_svd(dtype):
    for name, r, taken in cases(dtype):
        t = torch.from_numpy(r)
        u, h = _square.polar(t)
        u_svd, s, vh = _square.svd(t)
        values_only = _square.svd(t, compute_uv=False)
        iterate = _square._qdwh(t)
        if taken is not None:
            assert _square._accepted(iterate, iterate.mH @ t, t) == taken, name
        if taken:  # QDWH's own U is the answer (not the SVD's)
            assert torch.equal(u, iterate), name
        check(r, *(x.numpy() for x in (u, h, u_svd, s, vh, values_only)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_square_polar_and_svd(dtype):
    with jax.enable_x64(True):
        for name, r, taken in cases(dtype):
            u, h = jax.jit(jax_linalg._square_polar)(r)
            u_svd, s, vh = jax.jit(jax_linalg._square_svd)(r)
            values_only = jax.jit(lambda r: jax_linalg._square_svd(r, compute_uv=False))(r)
            iterate, _ = jax.scipy.linalg.polar(r, method="qdwh")
            if taken:  # QDWH's own U is the answer (not the SVD's)
                assert np.array_equal(np.asarray(u), np.asarray(iterate)), name
            check(r, *(np.asarray(x) for x in (u, h, u_svd, s, vh, values_only)), dtype)


def test_square_factors_of_a_matrix_with_nan():
    """Not finite: jax's answers are NaN (as jnp.linalg.svd's), torch's an error (as
    torch.linalg.svd's on the CPU), never numbers."""
    r = matrix(np.float64, None, 3)
    r[5, 7] = np.nan
    with jax.enable_x64(True):
        outputs = (*jax_linalg._square_polar(r), *jax_linalg._square_svd(r))
    assert all(np.isnan(np.asarray(x)).any() for x in outputs)
    for factor in (_square.polar, _square.svd):
        with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
            factor(torch.from_numpy(r))
