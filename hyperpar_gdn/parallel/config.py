"""What :func:`~hyperpar_gdn.parallel.compose.parallelize` applies: one frozen record of every
parallelism's options, checked on its own (no model, no mesh, no framework)."""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar_gdn.planning.plan import CPPlan, check_mode

__all__ = ["ParallelConfig"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallelisms of a model, applied by ``parallelize(model, mesh, config)`` in this order:
    expert parallelism, tensor parallelism, context parallelism, activation checkpointing, FSDP2.

    Args:
        tp: tensor-parallel ranks (the mesh's ``tp`` axis): blocks split by heads and columns.
        ep: expert-parallel ranks, consecutive ranks of the ``dp x cp`` ranks at one TP index: each
            MoE block's routed experts split by expert (those blocks then stay whole over tp).
        cp_mode: the context-parallel mode over the mesh's ``cp`` axis (``"auto"``: the cost
            model's choice for ``seq_len``), or None for no context parallelism; with it:
        cp_layout: the token layout, ``"contiguous"`` or ``"head_tail"``.
        cp_inner_size: ranks per inner group of a two-level mode (or of ``"auto"``).
        cp_chunk_size: chunk of the gated delta rule.
        gdn_kernel: the GDN layers' local kernel, ``"auto"``, ``"fla"`` or ``"native"``.
        seq_len: tokens per sequence, for ``cp_mode="auto"`` and only then.
        activation_checkpointing: recompute every decoder layer in the backward.
        fsdp: shard parameters, gradients and optimizer state over the ``dp x cp`` ranks (FSDP2;
            under expert parallelism the routed experts over the ranks that hold the same ones).
        bf16: compute in bf16: FSDP's gathered parameters (its shards and reductions stay fp32), and
            the dtype ``"auto"`` prices.
    """

    tp: int = 1
    ep: int = 1
    cp_mode: str | None = None
    cp_layout: str = "contiguous"
    cp_inner_size: int | None = None
    cp_chunk_size: int = 64
    gdn_kernel: str = "auto"
    seq_len: int | None = None
    activation_checkpointing: bool = False
    fsdp: bool = False
    bf16: bool = False

    def errors(self) -> list[Exception]:
        """Every rule these options break, one line each naming the value (empty: none)."""
        found: list[Exception] = []
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(ValueError(f"{name}={value!r} must be a positive int"))
        for name in ("activation_checkpointing", "fsdp", "bf16"):
            if not isinstance(getattr(self, name), bool):
                found.append(ValueError(f"{name}={getattr(self, name)!r} must be True or False"))
        if self.cp_mode is None:
            given = [
                f"{name}={getattr(self, name)!r}"
                for name, unset in (
                    ("cp_layout", "contiguous"),
                    ("cp_inner_size", None),
                    ("cp_chunk_size", 64),
                    ("gdn_kernel", "auto"),
                    ("seq_len", None),
                )
                if getattr(self, name) != unset
            ]
            if given:
                found.append(
                    ValueError(
                        f"{', '.join(given)}: options of context parallelism, which cp_mode=None leaves off"
                    )
                )
        else:
            found += self._cp_errors()
        return found

    def cp_plan(self) -> CPPlan | None:
        """The context-parallel plan these options name, None without context parallelism or for
        ``"auto"`` (which ``parallelize`` resolves against the model and the mesh)."""
        if self.cp_mode in (None, "auto"):
            return None
        return CPPlan(
            mode=self.cp_mode,
            layout=self.cp_layout,
            inner_size=self.cp_inner_size,
            chunk_size=self.cp_chunk_size,
            kernel=self.gdn_kernel,
        )

    def _cp_errors(self) -> list[Exception]:
        auto = self.cp_mode == "auto"
        try:
            check_mode(self.cp_mode, allow_auto=True)
            if auto != (self.seq_len is not None):
                raise ValueError(
                    f"seq_len is given with cp_mode='auto' and only then; got seq_len={self.seq_len!r}"
                )
            if not auto:
                self.cp_plan()  # the plan's own checks
                return []
            for name in ("seq_len", "cp_inner_size"):
                value = getattr(self, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"{name}={value!r} must be a positive int")
            CPPlan(mode="p2p", layout=self.cp_layout, chunk_size=self.cp_chunk_size, kernel=self.gdn_kernel)
        except ValueError as error:
            return [ValueError(f"cp_mode={self.cp_mode!r}: {error}")]
        return []
