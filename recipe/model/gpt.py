"""Build a megatron-core GPTModel for packed sequences, with the recipe's attention plugged in.

The layer spec is megatron-core's own local spec (RMSNorm, SwiGLU-free MLP) with one change: core
attention is replaced by the recipe's varlen attention (`torch` backend) or Transformer Engine's
(`te` backend, GPU only). Weights are created on the CPU in fp32 from `torch.manual_seed`, so every
CP rank starts from identical weights and runs at different cp are comparable.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from recipe.data.packing import PackedBatch
from recipe.environment import cuda_available
from recipe.megatron.log_filters import silence_known_warnings
from recipe.megatron.rope import install_thd_rope
from recipe.names import CU_SEQLENS_Q


def resolve_attention_backend(name: str) -> str:
    """`auto` means Transformer Engine when CUDA and TE are present, else the recipe's own."""
    if name == "auto":
        if cuda_available():
            try:
                import transformer_engine  # noqa: F401

                return "te"
            except ImportError:
                return "torch"
        return "torch"
    if name == "te" and not cuda_available():
        raise ValueError(
            "model.attention_backend=te needs CUDA and transformer-engine; on CPU use "
            "model.attention_backend=torch (or auto)"
        )
    return name


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The embedding's row count: the tokenizer's vocabulary rounded up to `multiple` (the same at
    every tp, so runs at different tp train the same model). Padded ids are never inputs or
    labels; their logits only take part in the softmax, as in Megatron-LM."""
    return -(-vocab_size // multiple) * multiple


def build_transformer_config(
    model_cfg,
    *,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    mtp_cfg=None,
    deterministic: bool = True,
    cp_comm_type: str = "p2p",
    mrope_section: list[int] | None = None,
    pp_size: int = 1,
    calculate_per_token_loss: bool = True,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    mtp_on = mtp_cfg is not None and mtp_cfg.enabled
    return TransformerConfig(
        mtp_num_layers=mtp_cfg.num_layers if mtp_on else None,
        mtp_loss_scaling_factor=mtp_cfg.loss_scaling_factor if mtp_on else 0.1,
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        **({"gated_linear_unit": True, "activation_func": F.silu} if model_cfg.swiglu else {}),
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        init_method_std=model_cfg.init_method_std,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel,
        context_parallel_size=cp_size,
        pipeline_model_parallel_size=pp_size,
        # THD micro-batches differ in length: stages exchange each one's shape first
        variable_seq_lengths=pp_size > 1,
        # no experts here; megatron checks this pairing with variable lengths regardless
        **({"moe_token_dispatcher_type": "alltoall"} if pp_size > 1 else {}),
        pipeline_dtype=torch.float32 if pp_size > 1 else None,
        cp_comm_type=cp_comm_type if cp_size > 1 else None,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        # Per-token losses summed over the step and divided once by the global count make the
        # result independent of how a step is cut into micro-batches and ranks (false only for
        # megatron's engine run on its other normalisation, trainer.megatron.*)
        calculate_per_token_loss=calculate_per_token_loss,
        deterministic_mode=deterministic,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        mrope_section=list(mrope_section) if mrope_section else None,
    )


class TorchRMSNorm:
    """megatron's `WrappedTorchNorm` (torch.nn.RMSNorm) for the torch backend, which also runs
    under sequence parallelism: the weight is marked `sequence_parallel`, so the trainer sums its
    gradient over tensor-parallel ranks (each saw only its share of the tokens). megatron's own
    wrapper refuses sequence parallelism; TE's and Apex's norms are not available on CPU."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def build_layer_spec(backend: str):
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from recipe.model.attention import PackedCausalAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    spec.submodules.input_layernorm = TorchRMSNorm
    spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    return spec


def _use_recipe_norms(mtp_block_spec) -> None:
    """The MTP layers' own norms (embedding, hidden, final) on the torch backend."""
    for layer_spec in mtp_block_spec.layer_specs:
        for name in ("enorm", "hnorm", "layer_norm"):
            setattr(layer_spec.submodules, name, TorchRMSNorm)


def build_gpt_model(
    model_cfg,
    *,
    vocab_size: int,
    max_sequence_length: int,
    seed: int,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    mtp_cfg=None,
    device: torch.device | None = None,
    deterministic: bool = True,
    cp_comm_type: str = "p2p",
    mrope_section: list[int] | None = None,
    pp_size: int = 1,
    calculate_per_token_loss: bool = True,
):
    """A GPTModel with identical initial weights on every rank that shares `seed`.

    At `pp_size` > 1 it is this rank's pipeline stage (megatron's pre/post_process, the MTP
    block on the last stage), whose weights are copied from the whole model built from `seed`:
    every layout starts from the weights of the pp=1 model.

    With `mtp_cfg.enabled` it carries megatron-core's multi-token-prediction block, built from the
    same layer spec, so the recipe's attention backend runs inside the MTP layers too. With
    `mrope_section` its rope is megatron's 3-D (mrope) variant, for vision mode.
    """
    silence_known_warnings()
    install_thd_rope()  # megatron's THD RoPE, bit for bit, without its host reads per layer
    settings = dict(
        model_cfg=model_cfg,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        seed=seed,
        cp_size=cp_size,
        tp_size=tp_size,
        sequence_parallel=sequence_parallel,
        mtp_cfg=mtp_cfg,
        deterministic=deterministic,
        cp_comm_type=cp_comm_type,
        mrope_section=mrope_section,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    if pp_size == 1:
        model = _build_stage(**settings)
    else:
        with _as_one_stage():
            whole = _build_stage(**settings)
        model = _build_stage(**settings, pp_size=pp_size)
        copy_into_stage(model, whole)
        del whole
    # Built on the CPU so every rank and device type starts from the same weights, then moved.
    return model.to(device) if device is not None else model


@contextlib.contextmanager
def _as_one_stage():
    """megatron's parallel state answers pp=1 (rank 0 of one stage) inside the block: how the
    whole model is built on a rank of a pipeline."""
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)


def stage_layer_offset(stage_model) -> int:
    """The global index of the stage's first decoder layer (megatron numbers layers globally,
    from 1, in `layer_number`; parameter names count from 0 on every stage)."""
    layers = stage_model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def whole_model_name(stage_name: str, layer_offset: int, tied_output: bool) -> str:
    """The name a stage's parameter has in the whole (pp=1) model: decoder layers renumbered
    from the stage's offset, a tied output layer on the last stage = the word embedding."""
    prefix = "decoder.layers."
    if stage_name.startswith(prefix):
        index, rest = stage_name[len(prefix) :].split(".", 1)
        return f"{prefix}{int(index) + layer_offset}.{rest}"
    if tied_output and stage_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return stage_name


def whole_model_names(stage_model) -> dict[str, str]:
    """{stage parameter name: its name in the whole model} of one pipeline stage."""
    offset = stage_layer_offset(stage_model)
    tied = bool(getattr(stage_model, "share_embeddings_and_output_weights", False))
    return {
        name: whole_model_name(name, offset, tied) for name, _ in stage_model.named_parameters()
    }


def copy_into_stage(stage_model, whole_model) -> None:
    """Give a pipeline stage the whole model's weights, parameter by parameter."""
    whole = dict(whole_model.named_parameters())
    params = dict(stage_model.named_parameters())
    with torch.no_grad():
        for name, whole_name in whole_model_names(stage_model).items():
            if whole_name not in whole or whole[whole_name].shape != params[name].shape:
                raise RuntimeError(
                    f"pipeline stage parameter {name} has no counterpart {whole_name} of shape "
                    f"{tuple(params[name].shape)} in the whole model: megatron's stage layout "
                    "changed and recipe/model/gpt.py must follow it"
                )
            params[name].copy_(whole[whole_name])


def _build_stage(
    *,
    model_cfg,
    vocab_size: int,
    max_sequence_length: int,
    seed: int,
    cp_size: int,
    tp_size: int,
    sequence_parallel: bool,
    mtp_cfg,
    deterministic: bool,
    cp_comm_type: str,
    mrope_section,
    calculate_per_token_loss: bool,
    pp_size: int = 1,
):
    """One GPTModel as megatron's parallel state places it (the whole model at pp=1)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    backend = resolve_attention_backend(model_cfg.attention_backend)
    config = build_transformer_config(
        model_cfg,
        cp_size=cp_size,
        tp_size=tp_size,
        sequence_parallel=sequence_parallel,
        mtp_cfg=mtp_cfg,
        deterministic=deterministic,
        cp_comm_type=cp_comm_type,
        mrope_section=mrope_section,
        pp_size=pp_size,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    layer_spec = build_layer_spec(backend)
    decoder_spec = layer_spec
    if backend != "te":
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        decoder_spec = TransformerBlockSubmodules(
            layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=TorchRMSNorm
        )
    mtp_block_spec = None
    if config.mtp_num_layers:
        mtp_block_spec = get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=backend == "te"
        )
        if backend != "te" and mtp_block_spec is not None:  # None: not this stage's
            _use_recipe_norms(mtp_block_spec)
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        mtp_block_spec=mtp_block_spec,
        vocab_size=padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by),
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        position_embedding_type="mrope" if mrope_section else model_cfg.position_embedding_type,
        rotary_base=model_cfg.rotary_base,
    )
    return model


def packed_seq_params(batch: PackedBatch, cu_seqlens_q: str = "padded"):
    """megatron's PackedSeqParams. The stream is laid out by the padded global boundaries, and
    attention and RoPE read them from the *_padded fields. `cu_seqlens_q` says what goes in
    cu_seqlens_q and cu_seqlens_kv: "padded", the padded offsets too (verl's convention, and
    the one megatron-core's MTP roll needs: it reads cu_seqlens_q alone); "real", the real
    offsets (Megatron-Bridge's packed SFT, Transformer Engine's THD convention), which the
    torch backend honours by masking the padding (recipe/model/attention.py)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cu_seqlens_q not in CU_SEQLENS_Q:
        raise ValueError(
            f"cu_seqlens_q must be one of {', '.join(CU_SEQLENS_Q)}, got {cu_seqlens_q!r}"
        )
    padded = batch.cu_seqlens_padded
    cu = padded if cu_seqlens_q == "padded" else batch.cu_seqlens
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )
