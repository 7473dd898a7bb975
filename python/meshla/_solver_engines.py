"""The dense solvers' engines, one set of rules and words for meshla.torch and meshla.jax:
"auto" (cuSolverMg over one process's GPUs, or each device solving the gathered A where that
cannot reach) and "cusolvermp" (cuSOLVERMp over one GPU in each process). Each front end adds
its own device rule (CUDA tensors, GPU devices)."""

from __future__ import annotations

from meshla import _meshla

ENGINES = ("auto", "cusolvermp")


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
