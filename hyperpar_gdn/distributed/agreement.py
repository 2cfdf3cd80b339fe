"""The ranks of a CP group agree on their plan before anything changes.

:func:`agree_on_plan` makes the ranks compare their :class:`~hyperpar_gdn.planning.plan.CPPlan`
and layer shapes in one small collective, so that a rank launched with another mode, layout or
model stops every rank with the same line instead of hanging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from hyperpar_gdn.ops.gdn.kernels import KERNELS
from hyperpar_gdn.planning.plan import LAYOUTS, MODES, TWO_LEVEL_MODES, CPPlan

__all__ = ["agree_on_plan", "first", "gather_verdicts", "ranks_by_value"]

# One int64 per rank: the plan's fields and the model's shapes packed into bit fields, so that a
# difference can be named (which field, which value on which ranks). -1: this rank refused its set-up.
_FIELDS = (("mode", 4), ("layout", 2), ("kernel", 2), ("inner_size", 8), ("chunk_size", 12),
           ("GDN layers", 8), ("layer shapes", 24))  # fmt: skip


def _fingerprint(plan: CPPlan, layers: Sequence[tuple[str, tuple]]) -> list[int]:
    shapes = hashlib.sha256(repr(list(layers)).encode()).digest()
    return [
        MODES.index(plan.mode) if plan.mode in MODES else len(MODES) + TWO_LEVEL_MODES.index(plan.mode),
        LAYOUTS.index(plan.layout),
        KERNELS.index(plan.kernel),
        plan.inner_size or 0,
        plan.chunk_size,
        sum(1 for kind, _ in layers if kind == "linear_attn"),
        int.from_bytes(shapes[:8], "big"),
    ]


def _pack(values: Sequence[int]) -> int:
    code, shift = 0, 0
    for (_, bits), value in zip(_FIELDS, values, strict=True):
        code |= (value % (1 << bits)) << shift
        shift += bits
    return code


def _unpack(code: int) -> list[int]:
    values, shift = [], 0
    for _, bits in _FIELDS:
        values.append((code >> shift) % (1 << bits))
        shift += bits
    return values


def _shown(name: str, value: int) -> str:
    if name == "mode":
        both = MODES + TWO_LEVEL_MODES
        return repr(both[value]) if value < len(both) else str(value)
    for key, names in (("layout", LAYOUTS), ("kernel", KERNELS)):
        if name == key:
            return repr(names[value]) if value < len(names) else str(value)
    return f"{value:07x}" if name == "layer shapes" else str(value)


def agree_on_plan(
    mesh: Any, plan: CPPlan, layers: Sequence[tuple[str, tuple]], error: Exception | None
) -> None:
    """Make every rank of the 1-D CP ``mesh`` stop with the same line unless all have the same plan
    and the same layers: one all-gather of one int per rank (call it on every rank, whatever its
    set-up; a mesh of one rank exchanges nothing).

    Args:
        mesh: the CP mesh (:class:`~hyperpar_gdn.distributed.mesh.DeviceMesh`).
        plan: this rank's plan; layers: (mixer kind, shape) of every decoder layer, in order.
        error: what this rank found wrong with its own set-up (raised here after the exchange; the
            other ranks raise a ValueError that says these ranks refused), or None.
    """
    if mesh.size() == 1:
        if error is not None:
            raise error
        return
    code = None if error is not None else _pack(_fingerprint(plan, layers))
    codes = gather_verdicts(mesh.platform.collectives, mesh.get_group(), code, error, ranks="CP ranks")
    differences = []
    for (name, _), values in zip(_FIELDS, zip(*(_unpack(c) for c in codes), strict=True), strict=True):
        if len(set(values)) > 1:
            differences.append(
                f"{name} ("
                + ", ".join(f"{_shown(name, v)} on ranks {r}" for v, r in ranks_by_value(values).items())
                + ")"
            )
    if differences:
        raise ValueError(
            "the CP ranks were given different set-ups: " + "; ".join(differences)
            + ": launch every rank of a CP group with the same mode, layout, kernel, inner size, chunk size and model"
        )  # fmt: skip


def gather_verdicts(
    collectives: Any, group: Any, code: int | None, error: Exception | None, *, ranks: str
) -> list[int]:
    """Every rank's ``code`` (a non-negative int saying what it was given; None where it refused
    with ``error``), by one all-gather over ``group``; raises this rank's own ``error``, or one line
    naming the ``ranks`` (e.g. ``"CP ranks"``) that refused, on every rank."""
    codes = collectives.all_gather_int(-1 if code is None else code, group)
    if error is not None:
        raise error
    refused = [r for r, c in enumerate(codes) if c < 0]
    if refused:
        raise ValueError(
            f"{ranks} {refused} refused their set-up (their own errors say why); every rank stops before "
            "changing the model"
        )
    return codes


def ranks_by_value(values: Sequence[Any]) -> dict[Any, list[int]]:
    """The ranks (positions in ``values``) that hold each distinct value, in first-seen order."""
    found: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        found.setdefault(value, []).append(rank)
    return found


def first(errors: Sequence[Exception]) -> Exception | None:
    """The first of ``errors`` (the one a rank raises), or None."""
    return errors[0] if errors else None
