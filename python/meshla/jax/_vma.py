"""shard_map's varying-axes types (``check_vma``) as meshla.jax's custom calls need them: the
axes an array varies over, casting an array to vary over more, and a custom call's result type."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over (none outside shard_map, or for None)."""
    return frozenset() if x is None else jax.typeof(x).mat.varying


def as_varying(x, axes: frozenset):
    """``x`` marked as varying over ``axes`` too (a custom call takes operands of one type)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def typed(shape, dtype, varying: frozenset):
    """A custom call's result inside shard_map: on the manual mesh, of the given varying axes."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(jax.sharding.get_abstract_mesh(), P()),
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
