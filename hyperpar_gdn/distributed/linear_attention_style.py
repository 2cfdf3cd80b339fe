"""The GDN layer's parallel style: :class:`LinearAttentionContextParallel` (modes in :mod:`.cp`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar_gdn.distributed.agreement import agree_on_plan, first
from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall, shard_lengths
from hyperpar_gdn.distributed.cp.conv_state import shard_conv_tail, whole_conv_state
from hyperpar_gdn.distributed.cp.packed_states import ShardPieces, doc_conv_states
from hyperpar_gdn.distributed.cp.state_passing import state_passing_forward
from hyperpar_gdn.distributed.cp.two_level import (
    Levels,
    make_levels,
    node_spans,
    two_level_forward,
    two_level_length_error,
)
from hyperpar_gdn.distributed.cp.ulysses import ulysses_forward
from hyperpar_gdn.distributed.cp.ulysses_hidden import ulysses_hidden_error, ulysses_hidden_forward
from hyperpar_gdn.distributed.decoder_layers import module_adapter_for
from hyperpar_gdn.distributed.dtensor import as_sequence_shard
from hyperpar_gdn.distributed.gdn_call import (
    CallArgs,
    check_lengths,
    packing_error,
    shard_error,
    signature_binder,
)
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, is_parallelized
from hyperpar_gdn.distributed.sequence import GlobalSequence, check_context
from hyperpar_gdn.ops.gdn.kernels import GDNKernel, kernel_for_inputs, platform_of, resolve_kernel
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, gdn_layer_forward, wrapped_weights_error
from hyperpar_gdn.ops.gdn.varlen import packed_doc_starts
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.planning.plan import (
    HEAD_MODES,
    MODES,
    CPPlan,
    cp_groups,
    plan_errors,
)
from hyperpar_gdn.platform import Tensor

__all__ = ["MODES", "LinearAttentionContextParallel", "layer_shape"]


class LinearAttentionContextParallel(ParallelStyle):
    """Context parallelism for a Qwen3.5 Gated DeltaNet layer.

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard of the
    sequence, ``[B, T_r, hidden]`` (in the ``contiguous`` layout rank r of the mesh holds the r-th
    contiguous piece, usually T/cp tokens, and the pieces may differ in length; under
    ``head_tail`` pieces r and 2cp-1-r of 2*cp), and gives exactly the
    single-device result. Parameters are untouched (state dict and optimizer
    as before); their gradients are this rank's share: sum them over the CP ranks with
    :func:`~hyperpar_gdn.sync_context_parallel_grads` (FSDP2 does it in its reduce-scatter).
    ``undo(module)`` restores the original forward. The shard may be a
    :class:`~hyperpar_gdn.DTensor` placed ``Shard(1, layout=...)`` in the style's layout (the
    output then has the same placement); any other placement is refused.
    The forward also takes ``prefill_states=``
    (:class:`~hyperpar_gdn.ops.prefill_states.PrefillStates`, an inference prefill's record): the
    layer then hands it its decoding state of the whole sequence, on every rank, in any mode and
    layout (with packed documents, one state per document; contiguous layout).

    Works on ``hyperpar_gdn.models.GatedDeltaNet``, on transformers' ``Qwen3_5GatedDeltaNet``
    (without a cache) and on the MindSpore layer.

    Args:
        mode: ``"ulysses"`` (head parallel, two all-to-alls; num_v_heads divisible by cp),
            ``"ulysses_hidden"`` (ulysses' head split, exchanging the layer's input and
            output ``[B, T, hidden]`` instead of the projected heads; fewer bytes when
            2 cp hidden < conv channels + 2H + H Dv, :mod:`.cp.ulysses_hidden`),
            ``"p2p"`` (state passing along a chain), ``"all_gather"`` (one all-gather of
            fp32 state summaries) or ``"scan"`` (a prefix scan of the summaries in
            ceil(log2 cp) rounds of point-to-point exchange); two levels, ``"ulysses+p2p"``,
            ``"ulysses+all_gather"`` or ``"ulysses+scan"``: ulysses inside groups of
            ``inner_size`` consecutive CP ranks (a node), the state mode across them
            (:mod:`.cp.two_level`). See docs/modes.md.
        chunk_size: tokens per chunk of the gated delta rule.
        layout: which tokens a rank holds (:mod:`hyperpar_gdn.distributed.layout`):
            ``"contiguous"`` (the r-th piece) or ``"head_tail"`` (pieces r and 2cp-1-r of 2*cp,
            concatenated: the layout that balances causal softmax attention).
        inner_size: for the two-level modes only (required there): ranks per inner group; it
            divides cp and the value heads. The CP groups must be the whole world or the cp axis
            of a row-major ``(dp, cp)`` or ``(dp, cp, tp)`` mesh: every process
            applies the style, as the inner and outer groups are made collectively.
        kernel: the local kernel of the gated delta rule (:mod:`hyperpar_gdn.ops.gdn.kernels`):
            ``"auto"`` (fla's Triton kernels on CUDA and Ascend where they import, else ours),
            ``"fla"`` (an error on every rank where they cannot run) or ``"native"`` (ours).
            ``kernel_choice`` says, once applied, which one runs and why.
        plan: a :class:`~hyperpar_gdn.CPPlan` instead of the keywords above.

    Example::

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode="p2p").apply(layer, mesh)
        y_local = layer(x_local)        # x_local: [B, T/4, hidden]
    """

    def __init__(
        self,
        mode: str = "ulysses",
        *,
        chunk_size: int = 64,
        layout: str = "contiguous",
        inner_size: int | None = None,
        kernel: str = "auto",
        plan: CPPlan | None = None,
    ) -> None:
        if plan is None:
            plan = CPPlan(
                mode=mode, layout=layout, inner_size=inner_size, chunk_size=chunk_size, kernel=kernel
            )
        elif not isinstance(plan, CPPlan):
            raise TypeError(f"plan must be a CPPlan; got {type(plan).__name__}")
        self.plan = plan
        self.kernel_choice: GDNKernel | None = None  # resolved on the mesh's platform by errors()
        self._levels_by_ranks: dict[tuple[int, ...], Levels] = {}

    mode = property(lambda self: self.plan.mode, doc="The plan's mode.")
    layout = property(lambda self: self.plan.layout, doc="The plan's token layout.")
    inner_size = property(lambda self: self.plan.inner_size, doc="The plan's inner group size.")
    chunk_size = property(lambda self: self.plan.chunk_size, doc="The plan's chunk size.")
    kernel = property(lambda self: self.plan.kernel, doc="The plan's local GDN kernel (as asked for).")

    def apply(self, module: Any, mesh: Any) -> Any:
        """Make ``module``'s forward take and return this rank's shard; returns ``module``.

        Args:
            module: a GDN layer (ours, transformers' ``Qwen3_5GatedDeltaNet`` or the MindSpore
                layer), changed in place; its parameters are untouched.
            mesh: the 1-D CP mesh (ours, e.g. ``mesh["cp"]``, or a 1-D torch ``DeviceMesh``).

        Call it on every rank of the mesh: the ranks first compare their plans and layer shapes
        (one all-gather of an int). Raises ``ValueError`` on every rank, before any change, when the
        plan cannot run on this layer and mesh (e.g. ulysses cannot split its heads over the mesh),
        when a rank was given another plan or layer, or when context parallelism is already applied.
        """
        cp_mesh = as_cp_mesh(mesh)
        errors = self.errors([(0, module)], cp_mesh)
        layers = [("linear_attn", layer_shape(module))]
        agree_on_plan(cp_mesh, self.plan, layers, first(errors))
        self.make_groups(cp_mesh)
        return self.install(module, cp_mesh)

    def errors(self, layers: list[tuple[int, Any]], cp_mesh: DeviceMesh, *, tp: int = 1) -> list[Exception]:
        """Why this style cannot be applied to the GDN layers ``(index, module)`` over ``cp_mesh``
        (``tp``: once tensor parallelism has split them over ``tp`` ranks)."""
        already = [i for i, module in layers if is_parallelized(module)]
        found: list[Exception] = [
            ValueError(f"layer {i} already has context parallelism applied; undo() it first")
            for i in already[:1]
        ]
        try:  # the same answer on every rank: the same platform and installed packages
            self.kernel_choice = resolve_kernel(self.plan.kernel, platform=cp_mesh.platform.name)
        except ValueError as error:
            found.append(error)
        dims = [(i, LayerDims.of(module).tp_rank(tp)) for i, module in layers]
        world = cp_mesh.platform.world_size()
        found += [NotImplementedError(e) for e in self._wrapper_errors(layers)][:1]
        return found + plan_errors(self.plan, dims, cp=cp_mesh.size(), ranks=cp_mesh.rank_list, world=world)

    def _wrapper_errors(self, layers: list[tuple[int, Any]]) -> list[str]:
        """The layers whose wrapped modules this plan would bypass (a conv or gated norm it reads
        the weight of; ulysses_hidden: a projection it slices)."""
        found = []
        for i, module in layers:
            where = f"layer {i}: linear_attn"
            error = wrapped_weights_error(module, where)
            if error is None and self.mode == "ulysses_hidden":
                error = ulysses_hidden_error(module, where)
            if error is not None:
                found.append(error)
        return found

    def make_groups(self, cp_mesh: DeviceMesh) -> None:
        """A two-level mode's inner and outer groups (made collectively, by every process, once per
        CP group: every process makes every CP group's, since the CP groups are the cp axis of a
        row-major mesh, checked by :meth:`errors`); nothing for the other modes."""
        ranks = tuple(cp_mesh.rank_list)
        if self.inner_size is None or ranks in self._levels_by_ranks:
            return
        replicas = cp_groups(ranks, cp_mesh.platform.world_size())  # checked by errors(): not None
        group = CPGroup.of(cp_mesh)
        levels = make_levels(cp_mesh.platform, group, list(ranks), self.inner_size, replicas=replicas)
        self._levels_by_ranks[ranks] = levels

    def install(self, module: Any, cp_mesh: DeviceMesh) -> Any:
        """Install the CP forward on ``module`` (checked and agreed on by :meth:`apply` or
        :func:`~hyperpar_gdn.apply_context_parallel`)."""
        group = CPGroup.of(cp_mesh)
        keywords = module_adapter_for(module).cu_seqlens_keywords

        def make_forward(original: Callable) -> Callable:
            bind = signature_binder(original, cu_seqlens_keywords=keywords)

            def forward(
                hidden_states: Any,
                *args: Any,
                prefill_states: PrefillStates | None = None,
                cp_context: GlobalSequence | None = None,
                **kwargs: Any,
            ) -> Any:
                call_args = bind(hidden_states, *args, **kwargs)
                return self._forward(module, group, hidden_states, call_args, prefill_states, cp_context)

            return forward

        return self._install(module, make_forward, layout=self.layout)

    def _forward(
        self,
        module: Any,
        cp: CPGroup,
        x: Any,
        call_args: CallArgs,
        states: PrefillStates | None,
        seq: GlobalSequence | None,
    ) -> Any:
        """The CP forward of one call; ``states``: an inference prefill's record, handed the
        layer's decoding state of the whole sequence on every rank (any mode, any layout);
        ``seq``: the model's per-forward context, or None (a layer called on its own, which then
        describes its own call: its shard lengths exchanged, its ``attention_mask`` and documents)."""
        owner = type(self).__name__
        x, wrap = as_sequence_shard(x, owner=owner, layout=self.layout)
        dims = LayerDims.of(module)
        if seq is not None:
            keywords = ("attention_mask", "cu_seqlens", "position_ids")
            seq = check_context(
                seq,
                "a GDN layer",
                layout=self.layout,
                rank=cp.rank,
                tokens=x.shape[1] if len(x.shape) > 1 else 0,
                given=[k for k in keywords if getattr(call_args, k) is not None],
                error=shard_error(dims, x, None),
            )
            attention_mask, cu_seqlens = seq.local_key_mask, seq.cu_seqlens
        else:
            attention_mask, _ = as_sequence_shard(call_args.attention_mask, owner=owner, layout=self.layout)
            cu_seqlens = call_args.cu_seqlens
        error = shard_error(dims, x, attention_mask)
        if self.kernel_choice is None:
            self.kernel_choice = resolve_kernel(self.plan.kernel, platform=platform_of(x))
        kernel = kernel_for_inputs(self.kernel_choice.name, self.plan.kernel, x)
        call = LayerCall(
            weights=LayerWeights.of(module), dims=dims, chunk_size=self.chunk_size, kernel=kernel
        )
        error = error or self._packed_prefill_error(cp, cu_seqlens, call_args.position_ids, states)
        if cp.size == 1:
            if error is not None:
                raise ValueError(error)
            doc_starts = (
                seq.whole_docs()
                if seq is not None
                else packed_doc_starts(
                    batch_size=x.shape[0],
                    seq_len=x.shape[1],
                    cu_seqlens=cu_seqlens,
                    position_ids=call_args.position_ids,
                )
            )
            y = gdn_layer_forward(
                cp.xp,
                call.weights,
                dims,
                x,
                attention_mask,
                chunk_size=self.chunk_size,
                doc_starts=doc_starts,
                output_final_state=states is not None,
                kernel=kernel,
            )
            if states is not None:
                y, (conv, s) = y
                states.keep_gdn(module, conv, s)
            return wrap(y)
        error = error or packing_error(x, cu_seqlens, call_args.position_ids)
        if seq is None:  # one exchange of the lengths (raises on every rank), the documents checked
            lengths = shard_lengths(cp, 0 if error else x.shape[1], error)
            seq = GlobalSequence.build(lengths, rank=cp.rank, layout=self.layout, cu_seqlens=cu_seqlens)
        elif error is not None:  # the model checked its input on every rank: this rank's own error
            raise ValueError(error)
        lengths, tokens = list(seq.lengths), seq.token_layout()
        if self._levels_by_ranks:
            return wrap(self._two_level(cp, call, x, attention_mask, lengths, seq, states))
        check_lengths(self.mode, dims, tokens)
        layout = None if tokens.is_contiguous else tokens
        heads = self.mode in HEAD_MODES
        if heads:  # the documents of the whole sequence, or those of this rank's shard: once per forward
            docs = seq.whole_docs()
        else:
            docs = seq.shard_docs(dims.conv_kernel_size, by_fragment=layout is not None)
        final = states is not None  # a prefill: the layer's decoding state too
        pieces = seq.shard_pieces() if final else None  # packed prompts: a state per prompt
        if heads:
            forward = ulysses_forward if self.mode == "ulysses" else ulysses_hidden_forward
            y = forward(cp, call, x, attention_mask, lengths, docs, layout, final_state=final)
        else:
            y = state_passing_forward(
                self.mode, cp, call, x, attention_mask, docs, layout, pieces=pieces, final_state=final
            )
        if states is not None:
            y, s = y
            states.keep_gdn(module, self._conv_state(cp, call, x, attention_mask, tokens, pieces), s)
        return wrap(y)

    def _packed_prefill_error(
        self, cp: CPGroup, cu_seqlens: Any, position_ids: Any, states: PrefillStates | None
    ) -> str | None:
        """Why this layer cannot record a state per packed prompt, or None."""
        packed = cu_seqlens is not None or position_ids is not None
        if states is None or not packed or (cp.size > 1 and self.layout == "contiguous"):
            return None
        return (
            "a prefill of packed prompts (a decoder's cache per prompt) needs context parallelism "
            f"over contiguous shards; got cp={cp.size}, layout={self.layout!r}"
        )

    @staticmethod
    def _conv_state(
        cp: CPGroup,
        call: LayerCall,
        x: Tensor,
        attention_mask: Tensor | None,
        tokens: TokenLayout,
        pieces: ShardPieces | None,
    ) -> Tensor:
        """The conv state of the whole sequence ``[B, C, W]`` or, for packed prompts, of every
        prompt ``[N, C, W]`` (the same on every rank)."""
        if pieces is not None:
            mixed = call.weights.qkv(x)
            return doc_conv_states(cp, pieces, mixed, tokens.lengths, call.dims.conv_kernel_size)
        tail = shard_conv_tail(cp, call.weights, x, attention_mask, tokens.mine(cp.rank))
        return whole_conv_state(cp, tail, tokens)

    def _two_level(
        self,
        cp: CPGroup,
        call: LayerCall,
        x: Any,
        attention_mask: Any,
        lengths: list[int],
        seq: GlobalSequence,
        states: PrefillStates | None,
    ) -> Any:
        """A two-level mode on this rank's shard, once the lengths are known on every rank
        (``seq``: the forward's context, which keeps the documents of the node's spans)."""
        if states is not None:
            raise NotImplementedError(
                f"mode={self.mode!r} does not record prefill states; use a one-level mode"
            )
        error = two_level_length_error(
            self.mode, lengths, self.inner_size, call.dims.conv_kernel_size, layout=self.layout
        )
        if error is not None:
            raise ValueError(error)
        state_mode = self.mode.split("+")[1]
        levels = next(v for v in self._levels_by_ranks.values() if v.flat_group is cp.group)
        spans = node_spans(lengths, self.inner_size, cp.rank, layout=self.layout)
        docs = seq.documents(spans, call.dims.conv_kernel_size)
        return two_level_forward(
            state_mode, levels, call, x, attention_mask, lengths, docs, layout=self.layout
        )


def layer_shape(module: Any) -> tuple[int, ...]:
    """What the CP ranks compare of a GDN layer: its dims (hidden size, heads, head dims, conv width)."""
    d = LayerDims.of(module)
    return (d.hidden_size, d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim, d.conv_kernel_size)
