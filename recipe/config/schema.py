"""The whole run's schema, `TrainConfig`: the groups together and the rules that span them
(budgets against sequence lengths, what tp, pp and cp split, vision's pairings, position ids).
The degree rules of the parallel grid itself are `ParallelDims`' (`layout.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recipe.config.groups import (
    BatchingConfig,
    CompareConfig,
    ConventionConfig,
    CPConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    MTPConfig,
    MutantConfig,
    OptimConfig,
    ParallelConfig,
    TrainerConfig,
    VisionConfig,
)
from recipe.config.layout import ParallelDims
from recipe.config.rules import require


@dataclass
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    convention: ConventionConfig = field(default_factory=ConventionConfig)
    mutant: MutantConfig = field(default_factory=MutantConfig)
    output_dir: str | None = None
    """Where outputs go; set from Hydra's run directory by train.py."""

    def __post_init__(self) -> None:
        dims = self.parallel_dims  # every degree rule, checked before anything uses the sizes
        alignment = dims.alignment
        aligned_max = math.ceil(self.data.max_seq_len / alignment) * alignment
        require(
            self.batching.max_tokens_per_rank * self.cp.size >= aligned_max,
            f"batching.max_tokens_per_rank={self.batching.max_tokens_per_rank} cannot hold one "
            f"sequence of data.max_seq_len={self.data.max_seq_len} ({aligned_max} tokens after "
            f"padding to a multiple of {alignment}, {aligned_max // self.cp.size} per rank at "
            f"cp={self.cp.size}); raise the budget to at least {aligned_max // self.cp.size} or "
            "lower data.max_seq_len",
        )
        require(
            self.batching.tokens_per_step >= self.data.max_seq_len,
            f"batching.tokens_per_step={self.batching.tokens_per_step} is smaller than one "
            f"sequence (data.max_seq_len={self.data.max_seq_len}); raise it or lower max_seq_len",
        )

        self._check_tensor_parallel()
        self._check_vision()
        self._check_pipeline_parallel()
        require(
            not self.trainer.trace_steps or self.parallel.tp == 1,
            f"trainer.trace_steps needs parallel.tp=1 (a trace keeps whole hidden vectors; at "
            f"tp={self.parallel.tp} each rank holds a slice of some); trace at cp/dp > 1 and tp=1",
        )

        require(
            not (
                self.trainer.trace_steps
                and self.trainer.engine == "megatron"
                and self.trainer.megatron.use_distributed_optimizer
            ),
            "trainer.trace_steps with trainer.megatron.use_distributed_optimizer=true: each rank "
            "then holds the summed gradient of its optimizer shard only, not of every parameter; "
            "trace with use_distributed_optimizer=false",
        )

        if self.cp.comm_type == "a2a" and self.cp.size > 1:
            m = self.model
            require(
                m.num_attention_heads % self.cp.size == 0
                and m.num_query_groups % self.cp.size == 0,
                f"cp.comm_type=a2a splits heads across cp ranks: model.num_attention_heads="
                f"{m.num_attention_heads} and model.num_query_groups={m.num_query_groups} must be "
                f"divisible by cp.size={self.cp.size}; use cp.comm_type=p2p",
            )

        if not self.passes_position_ids:
            policy = f"model.pass_position_ids={self.model.pass_position_ids}"
            require(
                self.model.position_embedding_type != "learned_absolute",
                f"model.position_embedding_type=learned_absolute needs position_ids, but {policy} "
                f"passes none here (mtp={'on' if self.mtp.enabled else 'off'}); use "
                "model.pass_position_ids=auto or always",
            )
            require(
                not self.mtp.enabled,
                f"mtp=on needs position_ids (the MTP block embeds the shifted tokens at their "
                f"positions), but {policy} passes none; use model.pass_position_ids=auto or always",
            )

    def _check_vision(self) -> None:
        """Vision mode's pairings, before any model is built."""
        v, m, source = self.vision, self.model, self.data.source
        if not v.enabled:
            require(
                source != "shapes",
                "data=shapes holds images and their captions; train it with vision=on (a text "
                "model would see only placeholder tokens)",
            )
            return
        require(
            source == "shapes",
            f"vision=on needs a data source with images, but data.source={source} is text only; "
            "use data=shapes (generated image-caption pairs)",
        )
        size, patch = self.data.shapes.image_size, v.patch_size
        require(
            size % patch == 0,
            f"data.shapes.image_size={size} is not a multiple of vision.patch_size={patch}; "
            "choose an image size that the patches tile",
        )
        require(
            (size // patch) % v.merge == 0,
            f"images of {size} px in patches of {patch} give a {size // patch} x {size // patch} "
            f"patch grid, which vision.merge={v.merge} does not divide; choose vision.merge, "
            "vision.patch_size or data.shapes.image_size so that it does",
        )
        head_dim = m.hidden_size // m.num_attention_heads
        require(
            sum(v.mrope_section) * 2 == head_dim,
            f"vision.mrope_section={list(v.mrope_section)} sums to {sum(v.mrope_section)}, but "
            f"mrope needs half the head dimension: model.hidden_size / "
            f"model.num_attention_heads / 2 = {head_dim // 2}",
        )
        require(
            m.position_embedding_type == "rope",
            f"vision=on uses 3-D rotary positions (mrope) in place of model.position_embedding_"
            f"type={m.position_embedding_type}; use model.position_embedding_type=rope",
        )
        require(
            self.parallel.tp == 1,
            f"vision=on runs at parallel.tp=1 (the vision encoder is not split across "
            f"tensor-parallel ranks); got parallel.tp={self.parallel.tp}: use cp and parallel.dp",
        )

    @property
    def image_grid(self) -> tuple[int, int] | None:
        """Merged patch grid (h, w) of one image (vision=on), else None."""
        if not self.vision.enabled:
            return None
        side = self.data.shapes.image_size // self.vision.patch_size // self.vision.merge
        return (side, side)

    def _check_pipeline_parallel(self) -> None:
        """Pipeline stages run only on megatron's engine, and only what it splits evenly."""
        pp, engine = self.parallel.pp, self.trainer.engine
        if pp == 1:
            return
        require(
            engine == "megatron",
            f"parallel.pp={pp}: pipeline parallelism runs on megatron-core's own schedule (1F1B); "
            f"trainer.engine={engine} runs its micro-batches itself. Remove "
            f"trainer.engine={engine} (the default is megatron)",
        )
        require(
            self.model.num_layers % pp == 0,
            f"parallel.pp={pp} splits model.num_layers={self.model.num_layers} into equal "
            f"stages; choose model.num_layers as a multiple of {pp}",
        )
        require(
            not self.vision.enabled,
            f"parallel.pp={pp} with vision=on is not supported (the vision encoder is not split "
            "into stages); use parallel.pp=1 with vision=on",
        )
        require(
            not self.trainer.trace_steps,
            f"trainer.trace_steps needs parallel.pp=1 (a trace hooks every module of one whole "
            f"model; at pp={pp} each rank holds one stage); trace at pp=1",
        )

    def _check_tensor_parallel(self) -> None:
        """What tp splits must divide by tp: megatron would fail later, deep inside a layer."""
        tp, m = self.parallel.tp, self.model
        for name, value in (
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_query_groups", m.num_query_groups),
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ):
            require(
                value % tp == 0,
                f"parallel.tp={tp} splits {name}={value} across tensor-parallel ranks, but it is "
                f"not divisible by {tp}; choose {name} as a multiple of {tp} or a smaller "
                "parallel.tp",
            )

    @property
    def passes_position_ids(self) -> bool:
        """Whether the model call receives position_ids, by `model.pass_position_ids`."""
        policy, mtp, vision = self.model.pass_position_ids, self.mtp.enabled, self.vision.enabled
        if policy == "always":
            return True
        if policy == "never":
            return False
        if policy == "mtp_only":
            return mtp
        if policy == "not_vision":
            return not vision
        # auto: exactly when something reads them. With rope megatron derives positions from the
        # packed boundaries, so 1-D ids are only read by learned absolute embeddings and by the MTP
        # block (which rolls them, and on megatron-core 0.16 fails without them). A vision model
        # builds its own 3-D ids; its rope ignores 1-D ones by design (recipe/model/mrope.py).
        return mtp or (self.model.position_embedding_type == "learned_absolute" and not vision)

    @property
    def parallel_dims(self) -> ParallelDims:
        return ParallelDims(
            tp=self.parallel.tp, cp=self.cp.size, dp=self.parallel.dp, pp=self.parallel.pp
        )

    @property
    def alignment(self) -> int:
        """Each sequence is padded to a multiple of this (see ParallelDims.alignment)."""
        return self.parallel_dims.alignment

    @property
    def world_size(self) -> int:
        return self.parallel_dims.world_size


def register_configs() -> None:
    """Register the schemas with Hydra so YAML files are validated against them."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
