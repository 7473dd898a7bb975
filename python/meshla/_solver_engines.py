"""The dense solvers' engines, one set of rules and words for meshla.torch and meshla.jax:
"cusolvermg" (cuSolverMg over one process's GPUs, or each device solving the gathered A where
that cannot reach), "cusolvermp" (cuSOLVERMp over one GPU in each process), and "auto": the
Cholesky and LU solves on cuSOLVERMp where their GPUs are in several processes, one each, and
every process has it (on 2x H200 2.5-3.3x the first rank's cuSolverMg through CUDA IPC, and up
to 1.7x one GPU, where the others gather A: bench/NOTES.md 112), cuSolverMg otherwise. Each
front end adds its own device rule (CUDA tensors, GPU devices)."""

from __future__ import annotations

from meshla import _meshla

ENGINES = ("auto", "cusolvermg", "cusolvermp")


def engine_misfit(name: str, engine: str, not_on_gpus: str | None) -> str | None:
    """Why ``engine`` cannot run in this process, in ``name``'s words, or None: a name it is
    not; for "cusolvermp", ``not_on_gpus`` (the front end's words where its operands are not on
    GPUs, None where they are), then cuSOLVERMp missing."""
    if engine not in ENGINES:
        return f"{name}: engine={engine!r}; expected one of {ENGINES}"
    if engine == "cusolvermp":
        if not_on_gpus is not None:
            return f"{name}: engine='cusolvermp' runs on {not_on_gpus}"
        why = _meshla.ProcessSolver.unavailable_reason()
        if why:
            return f"{name}: engine='cusolvermp' cannot run: {why}"
    return None


def cusolvermp_takes(ranks: int) -> bool:
    """Whether "auto" may take cuSOLVERMp for a solve over ``ranks`` processes, one GPU each:
    several of them, no more than its solver takes."""
    return 1 < ranks <= _meshla.ProcessSolver.max_ranks()


def cusolvermp_installed() -> bool:
    """Whether this process has cuSOLVERMp (meshla built with it, a library that opens; its
    version is checked when the solver is made, and another release installed instead of 0.8
    raises then: engine="cusolvermg" avoids it). "auto" takes it only where every process has
    it: torch agrees on that in the call's exchange, JAX through jax.distributed's store."""
    return not _meshla.ProcessSolver.unavailable_reason()
