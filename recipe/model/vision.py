"""vision=on: a small vision-language model around the recipe's GPT.

A ViT (megatron-core `TransformerBlock` with its ViT layer spec, bidirectional attention over each
image's patches) encodes every image of the micro-batch, a 2x2 merge joins neighbouring patches,
megatron's `MultimodalProjector` maps them to the language model's width, and the result replaces
the placeholder tokens' embeddings. Every CP rank encodes the micro-batch's images whole and
takes the rows its own tokens need (`image_slot`, sharded with the same zigzag index as the
tokens), so the image embeddings are CP-sharded exactly like the text; the ViT's gradients, each
rank's share from its own tokens, add up to the whole over the gradient all-reduce.

3-D positions are computed here, in the model, on the full unsharded stream, and handed to
megatron's THD rope path as the table of the whole stream (recipe/model/mrope.py). The other
values of `vision.positions` are negative controls that deliver them wrongly.
"""

from __future__ import annotations

import dataclasses

import torch

from recipe.model.mrope import (
    StreamRotaryEmbedding,
    rope_table,
    stream_mrope_positions,
)
from recipe.parallel.cp.zigzag import local_token_identity, zigzag_index


def _encoder_side_config(lm_config, **sizes):
    """The language model's numerics for a part that sees whole images: no context
    parallelism (images are not split), no MTP, no mrope, a plain MLP."""
    return dataclasses.replace(
        lm_config,
        gated_linear_unit=False,
        context_parallel_size=1,
        cp_comm_type=None,
        mtp_num_layers=None,
        mrope_section=None,
        **sizes,
    )


def build_vision_config(vision_cfg, lm_config):
    """The ViT's TransformerConfig: the encoder's own sizes."""
    heads = vision_cfg.num_attention_heads
    return _encoder_side_config(
        lm_config,
        num_layers=vision_cfg.num_layers,
        hidden_size=vision_cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=vision_cfg.ffn_hidden_size,
        kv_channels=vision_cfg.hidden_size // heads,
    )


def build_projector_config(lm_config):
    """The projector's TransformerConfig: an MLP whose inner width is the language model's."""
    return _encoder_side_config(lm_config, ffn_hidden_size=lm_config.hidden_size)


def _vit_block_spec(num_layers: int):
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from recipe.model.attention import ImageAttention
    from recipe.model.gpt import TorchRMSNorm

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ImageAttention
    spec.submodules.input_layernorm = TorchRMSNorm
    spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TorchRMSNorm)


class VisionEncoder(torch.nn.Module):
    """Images [n, 3, H, W] -> merged patch features [n, patches / merge^2, merge^2 * hidden]."""

    def __init__(self, config, patch_size: int, merge: int, image_size: int):
        from megatron.core.transformer.transformer_block import TransformerBlock

        super().__init__()
        self.patch_size, self.merge = patch_size, merge
        self.grid = image_size // patch_size
        hidden = config.hidden_size
        self.patch_embedding = torch.nn.Linear(3 * patch_size * patch_size, hidden)
        self.patch_positions = torch.nn.Parameter(
            torch.randn(self.grid * self.grid, hidden) * config.init_method_std
        )
        self.transformer = TransformerBlock(
            config=config, spec=_vit_block_spec(config.num_layers), pre_process=True
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, p, g, m = images.shape[0], self.patch_size, self.grid, self.merge
        patches = images.unfold(2, p, p).unfold(3, p, p)  # [n, 3, g, g, p, p]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(n, g * g, 3 * p * p)
        x = self.patch_embedding(patches) + self.patch_positions
        x = self.transformer(hidden_states=x.transpose(0, 1).contiguous(), attention_mask=None)
        x = x.transpose(0, 1).reshape(n, g // m, m, g // m, m, -1)
        # Row-major over the merged grid, as the 3-D positions number the image's tokens.
        return x.permute(0, 1, 3, 2, 4, 5).reshape(n, (g // m) ** 2, -1)


class VisionLanguageModel(torch.nn.Module):
    """The GPT with image embeddings in place of its placeholder tokens and 3-D positions."""

    def __init__(
        self,
        language_model,
        vision_encoder: VisionEncoder,
        vision_projection,
        mrope_section: list[int],
        positions: str,
        cp_size: int,
        cp_rank: int,
    ):
        super().__init__()
        # megatron's DDP and schedules read the model's config: the language model's, as in
        # megatron's own multimodal models
        self.config = language_model.config
        self.model_type = language_model.model_type
        self.language_model = language_model
        self.vision_encoder = vision_encoder
        self.vision_projection = vision_projection
        # Replaces megatron's module inside the GPT (not registered here a second time).
        language_model.rotary_pos_emb = StreamRotaryEmbedding(language_model.rotary_pos_emb)
        self.mrope_section = list(mrope_section)
        self.positions = positions
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def set_input_tensor(self, input_tensor) -> None:
        """megatron's schedules hand a pipeline stage its input here (vision runs at pp=1)."""
        self.language_model.set_input_tensor(input_tensor)

    @property
    def rope(self) -> StreamRotaryEmbedding:
        return self.language_model.rotary_pos_emb

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """[images x tokens per image, hidden] in slot order."""
        merged = self.vision_encoder(images)
        n, k, width = merged.shape
        projected = self.vision_projection(merged.reshape(n * k, 1, width))
        return projected.reshape(n * k, -1)

    def stream_table(self, batch) -> torch.Tensor:
        """The rope table of the whole packed stream, [T_global, 1, 1, dim], by
        `vision.positions`; its length is what makes megatron's THD path slice it per sequence."""
        cu = batch.cu_seqlens_padded
        if self.positions == "text_1d":
            _, within, _ = local_token_identity(cu.cpu(), 1, 0)  # 1-D position in its sequence
            ids = within.to(cu.device).expand(3, -1)
        elif self.positions != "rank_local" or self.cp_size == 1:
            ids = stream_mrope_positions(cu, batch.stream_image_slot, batch.image_grids)
        if self.positions in ("full_stream", "text_1d") or self.cp_size == 1:
            table = rope_table(self.rope, ids, self.mrope_section)
        else:
            if self.positions == "rank_local":
                # Computed after sharding: the rank's two chunks of each sequence read as one
                # sequence, with the local image tokens.
                local = stream_mrope_positions(
                    torch.div(cu, self.cp_size, rounding_mode="floor"),
                    batch.image_slot,
                    batch.image_grids,
                )
                mine = rope_table(self.rope, local, self.mrope_section)
            else:
                # stock_sharded: megatron's MultimodalRotaryEmbedding shards its table with
                # get_pos_emb_on_this_cp_rank, chunks r and 2cp-1-r of the WHOLE stream as if it
                # were one sequence (that function needs CUDA; the same rule by the recipe's
                # index, checked against it in tests/test_vision.py).
                whole = torch.tensor([0, int(cu[-1])], dtype=torch.int32)
                rows = zigzag_index(whole, self.cp_size, self.cp_rank).to(cu.device)
                mine = rope_table(self.rope, ids, self.mrope_section)[rows]
            index = zigzag_index(cu.cpu(), self.cp_size, self.cp_rank).to(cu.device)
            table = mine.new_zeros((int(cu[-1]),) + tuple(mine.shape[1:]))
            table[index] = mine  # each local token gets the row computed for it
        if table.shape[0] != int(cu[-1]):
            raise RuntimeError(
                f"the mrope table has {table.shape[0]} rows, the packed stream "
                f"{int(cu[-1])}: megatron's THD rope would not slice it per sequence"
            )
        return table

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        labels,
        packed_seq_params,
        batch,
        loss_mask=None,
    ):
        images = self.image_embeddings(batch.images)
        text = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        slot = batch.image_slot
        rows = images.index_select(0, slot.clamp(min=0)).unsqueeze(1)  # [T_local, 1, hidden]
        decoder_input = torch.where((slot >= 0).view(-1, 1, 1), rows, text)
        self.rope.table = self.stream_table(batch)
        try:
            return self.language_model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                decoder_input=decoder_input,
                labels=labels,
                packed_seq_params=packed_seq_params,
                loss_mask=loss_mask,
            )
        finally:
            self.rope.table = None


def language_model_of(model):
    """The GPTModel inside (itself for a text model): where megatron's loss functions live."""
    return getattr(model, "language_model", model)


def build_vision_language_model(
    language_model, vision_cfg, image_size: int, seed: int, cp_size: int, cp_rank: int
):
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    lm_config = language_model.config
    torch.manual_seed(seed + 1)  # the same encoder on every rank, independent of the GPT's draws
    vit_config = build_vision_config(vision_cfg, lm_config)
    encoder = VisionEncoder(vit_config, vision_cfg.patch_size, vision_cfg.merge, image_size)
    projection = MultimodalProjector(
        build_projector_config(lm_config),
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        projector_type="mlp",
        input_size=vision_cfg.merge**2 * vision_cfg.hidden_size,
    )
    return VisionLanguageModel(
        language_model,
        encoder,
        projection,
        vision_cfg.mrope_section,
        vision_cfg.positions,
        cp_size,
        cp_rank,
    )
