"""The groups of the schema: one dataclass per Hydra group (and its sub-sections), each field with
its default, its docstring and its check in `__post_init__`, a message naming the field and what
would be valid. Rules that span groups live on `TrainConfig` (`schema.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recipe.config.preprocess import check_preprocess_spelling
from recipe.config.rules import one_of, positive, require
from recipe.names import (
    ANCHOR_EVERY,
    ANCHOR_STEPS,
    ATTENTION_BACKENDS,
    CP_COMM_TYPES,
    CU_SEQLENS_Q,
    DATA_SOURCES,
    ENGINES,
    FP32_RTOL,
    MTP_LOSS_MASKS,
    MTP_SCALINGS,
    MUTANTS,
    NOISE_FLOORS,
    NOISE_MARGIN,
    NONFINITE_ACTIONS,
    PASS_POSITION_IDS,
    POSITION_EMBEDDINGS,
    PRECISIONS,
    SEQUENCE_ORDERS,
    SPIKE_ACTIONS,
    VISION_POSITIONS,
    WANDB_MODES,
)


@dataclass
class ModelConfig:
    """A megatron-core GPT. Vocabulary size comes from the tokenizer."""

    name: str = "tiny"
    """The preset's name (set by the model= group option; informational)."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width; divisible by num_attention_heads."""
    num_attention_heads: int = 2
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention); divides num_attention_heads."""
    ffn_hidden_size: int = 256
    """MLP inner width (of each branch with swiglu)."""
    swiglu: bool = False
    """SwiGLU MLP (gated, SiLU; Llama-style) instead of a plain GELU MLP."""
    position_embedding_type: str = "rope"
    """rope | learned_absolute (learned_absolute makes a position_ids bug visible in the loss)."""
    rotary_base: int = 10000
    """RoPE base frequency."""
    attention_backend: str = "auto"
    """auto | torch (the recipe's varlen attention, CPU or GPU) | te (Transformer Engine, GPU)."""
    init_method_std: float = 0.1
    """Std of the normal weight initialisation. 0.1 for this hidden size of 64 (about
    0.8/sqrt(hidden)): at 0.02 the first layer's residual stream is so small that one AdamW step
    (about lr per element) rotates its token-shared direction, and every later RMSNorm carries
    the flip to the logits (docs/stability.md). The larger model configs keep 0.02."""
    tie_embeddings: bool = False
    """Share input embedding and output layer weights."""
    make_vocab_size_divisible_by: int = 128
    """The embedding and output layer are padded to a multiple of this (megatron's convention), the
    same at every tp so that runs at different tp train the same model; must divide by tp."""
    pass_position_ids: str = "auto"
    """When the model call gets position_ids: auto (whenever learned positions or the MTP block
    read them; a vision model's rope ignores them by design) | mtp_only (verl after PR #6267) |
    not_vision (verl before it) | always | never."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "rotary_base",
            "make_vocab_size_divisible_by",
        ):
            positive(f"model.{name}", getattr(self, name))
        positive("model.init_method_std", self.init_method_std)
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.hidden_size={self.hidden_size} is not divisible by "
            f"model.num_attention_heads={self.num_attention_heads}; pick a hidden size that is a "
            "multiple of the head count",
        )
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_query_groups={self.num_query_groups} must divide "
            f"model.num_attention_heads={self.num_attention_heads}",
        )
        head_dim = self.hidden_size // self.num_attention_heads
        require(
            self.position_embedding_type != "rope" or head_dim % 2 == 0,
            f"rope needs an even head dimension; hidden_size/num_attention_heads = {head_dim}",
        )
        one_of("model.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        one_of("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        one_of("model.pass_position_ids", self.pass_position_ids, PASS_POSITION_IDS)


@dataclass
class MarkovConfig:
    """The generated default: documents from a seeded order-k Markov chain over a small alphabet."""

    order: int = 2
    """Context length k of the chain (>= 2 so that attention matters)."""
    alphabet_size: int = 16
    """Number of symbols; they are written as the letters a, b, c, ... so the text is readable."""
    concentration: float = 0.1
    """Dirichlet concentration of each context's next-symbol distribution: small = peaked."""
    mean_doc_len: int = 400
    """Mean document length in symbols; each context ends a document with rate ~1/mean."""
    max_doc_len: int = 2000
    """Documents still running at this length are cut (no end-of-text token then)."""
    num_train_docs: int = 4000
    """Documents generated for training."""
    num_eval_docs: int = 200
    """Documents generated for the held-out eval set."""

    def __post_init__(self) -> None:
        require(
            self.order >= 2,
            f"data.markov.order must be >= 2 (attention must matter), got {self.order}",
        )
        require(
            2 <= self.alphabet_size <= 26,
            f"data.markov.alphabet_size must be in 2..26, got {self.alphabet_size}",
        )
        for name in (
            "concentration",
            "mean_doc_len",
            "max_doc_len",
            "num_train_docs",
            "num_eval_docs",
        ):
            positive(f"data.markov.{name}", getattr(self, name))


@dataclass
class ShapesConfig:
    """data=shapes: generated image-caption pairs (recipe/data/shapes.py)."""

    num_train: int = 4000
    """Image-caption pairs generated for training."""
    num_eval: int = 200
    """Image-caption pairs generated for the held-out eval set."""
    image_size: int = 32
    """Side of the square RGB images, in pixels."""
    shuffle_images: bool = False
    """Pair every caption with another sample's image (a negative control: the images then say
    nothing about the captions, and the caption loss stays near the blind floor)."""

    def __post_init__(self) -> None:
        for name in ("num_train", "num_eval", "image_size"):
            positive(f"data.shapes.{name}", getattr(self, name))


@dataclass
class DataConfig:
    """Where documents come from and how they become token sequences."""

    source: str = "markov"
    """markov (generated, no network) | pydoc (English text shipped with CPython) | files."""
    seed: int = 1234
    """Seeds generation, the train/eval split and the data order."""
    max_seq_len: int = 2048
    """Longest sequence in tokens (BOS/EOS included); longer documents are split, never dropped."""
    eval_fraction: float = 0.05
    """Share of documents held out for eval (pydoc, files); markov uses markov.num_eval_docs."""
    max_eval_tokens: int = 32768
    """Cap on eval tokens, to keep periodic eval cheap."""
    tokenizer: str = "byte"
    """byte (256 bytes + BOS/EOS/PAD, no file) | path of a Hugging Face tokenizer.json."""
    path: str | None = None
    """files: a `datasets.load_dataset` builder (json, parquet, text, csv) or a hub dataset name."""
    name: str | None = None
    """files: dataset configuration name, if the dataset has several."""
    data_files: Any = None
    """files: file path, glob, list, or dict of split -> files."""
    split: str = "train"
    """files: split to read."""
    text_field: str = "text"
    """files: column holding the text."""
    max_malformed_fraction: float = 0.01
    """files: largest share of rows whose text is missing, null or not a string (they are skipped
    and counted); more is an error. Empty strings (blank lines) are skipped and counted only."""
    markov: MarkovConfig = field(default_factory=MarkovConfig)
    shapes: ShapesConfig = field(default_factory=ShapesConfig)

    def __post_init__(self) -> None:
        require(
            0 <= self.max_malformed_fraction <= 1,
            "data.max_malformed_fraction must be between 0 and 1, got "
            f"{self.max_malformed_fraction}",
        )
        one_of("data.source", self.source, DATA_SOURCES)
        require(self.max_seq_len >= 2, f"data.max_seq_len must be >= 2, got {self.max_seq_len}")
        require(self.seed >= 0, f"data.seed must be >= 0, got {self.seed}")
        require(
            0 < self.eval_fraction < 1,
            f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}",
        )
        positive("data.max_eval_tokens", self.max_eval_tokens)
        if self.source == "markov":
            # BOS + at most max_doc_len symbols (the final '.' included) + EOS.
            longest = self.markov.max_doc_len + 2
            require(
                longest <= self.max_seq_len,
                f"data.markov.max_doc_len={self.markov.max_doc_len} gives documents of up to "
                f"{longest} tokens, more than data.max_seq_len={self.max_seq_len}: they would be "
                f"cut and the entropy floor would no longer be exact; raise data.max_seq_len to "
                f"{longest} or lower data.markov.max_doc_len",
            )
        if self.source == "files":
            require(
                bool(self.path),
                "data=files needs data.path: a builder such as json, parquet, text or csv "
                "(with data.data_files=FILE), or a hub dataset name",
            )


@dataclass
class BatchingConfig:
    """Token-budget batching of whole sequences into packed THD micro-batches."""

    tokens_per_step: int = 4096
    """Real tokens per optimizer step (whole sequences, filled greedily up to this count)."""
    max_tokens_per_rank: int = 4096
    """Tokens one rank holds in a micro-batch after CP sharding, counted after alignment padding."""
    sequence_order: str = "data"
    """data | reversed: the order of the sequences inside each packed micro-batch. Reversed changes
    only the order in which token sums are taken, not what is computed: the noise twin that the
    comparison trains to learn a setting's fp32 rounding noise (docs/comparing-runs.md)."""

    def __post_init__(self) -> None:
        positive("batching.tokens_per_step", self.tokens_per_step)
        positive("batching.max_tokens_per_rank", self.max_tokens_per_rank)
        one_of("batching.sequence_order", self.sequence_order, SEQUENCE_ORDERS)


@dataclass
class CPConfig:
    """Context parallelism."""

    size: int = 1
    """Context-parallel ranks; each holds 2 zigzag chunks of every sequence."""
    preprocess: str = "index"
    """index (one zigzag index for every tensor) | verl_fixed | verl_legacy (pre-PR-6267 bug) |
    package.module:function (your own; the contract is in recipe/parallel/cp/contract.py) |
    LIBRARY@VERSION[/FUNCTION] (a released upstream function, e.g. verl@0.7.1, verl@installed;
    the wheel is fetched with pip into a cache at start-up)."""
    check_steps: int = 1
    """With your own preprocess function: check it against the index path on every micro-batch
    of the first this many steps, and stop at the first difference (0: do not check)."""
    comm_type: str = "p2p"
    """Transformer Engine's CP attention exchange: p2p (ring; THD in every TE 2.x) | a2a (TE >=
    2.10; heads and query groups divisible by cp) | all_gather (TE >= 2.15). The torch backend
    always all-gathers K/V."""

    def __post_init__(self) -> None:
        check_preprocess_spelling(self.preprocess)
        one_of("cp.comm_type", self.comm_type, CP_COMM_TYPES)
        require(self.check_steps >= 0, f"cp.check_steps must be >= 0, got {self.check_steps}")


@dataclass
class ParallelConfig:
    """Data and tensor parallel sizes; world size = tp * cp * dp (checked by ParallelDims)."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel size: 1, 2 or 4 (megatron-core's column/row-parallel linears, vocab-parallel
    embedding and cross entropy)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: with tp > 1, activations outside the tensor-parallel
    linears (norms, dropout, residuals) are split along the tokens across tp ranks."""
    pp: int = 1
    """Pipeline-parallel stages (megatron's 1F1B schedule: trainer.engine=megatron, the default).
    model.num_layers must be divisible by it; MTP layers sit on the last stage."""

    def __post_init__(self) -> None:
        require(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel=true splits tokens across tensor-parallel ranks and needs "
            "parallel.tp > 1; set parallel.tp=2 or parallel.sequence_parallel=false",
        )
        positive("parallel.pp", self.pp)


@dataclass
class MTPConfig:
    """Multi-token prediction: megatron-core's MTP block predicts tokens further ahead."""

    enabled: bool = False
    """mtp=on / mtp=off."""
    num_layers: int = 1
    """MTP depth: layer k (1-based) predicts the token k+1 positions after the next one."""
    loss_scaling_factor: float = 0.1
    """Weight of the MTP loss (mean over layers) in the optimised loss."""
    scaling: str = "exact"
    """How each MTP target is weighted in the gradient. exact: 1 / (global count of its layer
    over the step), so the MTP term is the mean over layers of each layer's global mean, whatever
    the layout. upstream: the installed megatron-core's own weighting, untouched (on 0.19 it
    depends on the CP/DP layout; see docs/findings.md)."""

    def __post_init__(self) -> None:
        positive("mtp.num_layers", self.num_layers)
        one_of("mtp.scaling", self.scaling, MTP_SCALINGS)
        require(
            self.loss_scaling_factor >= 0,
            f"mtp.loss_scaling_factor must be >= 0, got {self.loss_scaling_factor}",
        )


@dataclass
class VisionConfig:
    """Small vision-language mode: a ViT encoder, a 2x2 patch merge and megatron's multimodal
    projector in front of the GPT, with 3-D (mrope) positions."""

    enabled: bool = False
    """vision=on / vision=off."""
    patch_size: int = 8
    """Pixels per side of a ViT patch; divides the image size."""
    merge: int = 2
    """Patches per side merged into one language-model token; divides the patch grid."""
    num_layers: int = 2
    """ViT transformer layers."""
    hidden_size: int = 32
    """ViT width."""
    num_attention_heads: int = 2
    """ViT attention heads; divide hidden_size."""
    ffn_hidden_size: int = 64
    """ViT MLP inner width."""
    mrope_section: list[int] = field(default_factory=lambda: [4, 6, 6])
    """Rotary channel pairs given to the (t, row, col) axes; sums to half the language model's
    head dimension (Qwen2-VL's mrope_section)."""
    positions: str = "full_stream"
    """How the 3-D positions reach the rope: full_stream (computed on the whole packed stream,
    handed to megatron's THD rope unsharded: correct) | rank_local (computed after CP sharding
    from each rank's own tokens) | stock_sharded (sharded by megatron's stock
    MultimodalRotaryEmbedding, right only for unpacked BSHD) | text_1d (1-D text positions on all
    three axes). The last three are negative controls."""

    def __post_init__(self) -> None:
        for name in (
            "patch_size",
            "merge",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
        ):
            positive(f"vision.{name}", getattr(self, name))
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"vision.hidden_size={self.hidden_size} is not divisible by "
            f"vision.num_attention_heads={self.num_attention_heads}",
        )
        require(
            len(self.mrope_section) == 3 and all(int(v) >= 0 for v in self.mrope_section),
            f"vision.mrope_section={list(self.mrope_section)} must be three non-negative channel "
            "counts (t, row, col)",
        )
        one_of("vision.positions", self.positions, VISION_POSITIONS)


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 6e-3
    """Peak learning rate (reached after warmup_steps)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr, then cosine decay to min_lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        positive("optim.lr", self.lr)
        require(
            0 <= self.min_lr <= self.lr,
            f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}",
        )
        require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            f"optim.beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}",
        )
        positive("optim.eps", self.eps)
        require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class ConventionSource:
    """One choice of a convention and the upstream code that makes it."""

    choice: str
    """What the framework does, in a few words (one row of the conventions table)."""
    keys: list[str] = field(default_factory=list)
    """The recipe settings that re-create the choice (e.g. convention.cu_seqlens_q)."""
    where: str = ""
    """DISTRIBUTION==VERSION path:LINE[-LINE] in the released wheel (or REPO@TAG path:LINE where
    the file ships in no wheel)."""
    quote: str = ""
    """Text on those lines: a test reads the wheel's file and checks it is there."""

    def __post_init__(self) -> None:
        require(
            bool(self.where) == bool(self.quote),
            f"convention.sources: the choice {self.choice!r} needs both `where` (the upstream "
            "file:line) and `quote` (text on those lines), or neither",
        )


@dataclass
class ConventionConfig:
    """How batches and options reach megatron-core: the recipe's way, or a framework's
    (conf/convention/*.yaml: each sets these keys and the existing ones its framework chooses,
    and names the upstream file:line of every choice). docs/conventions.md: which of them train
    the cp=1 model."""

    name: str = "recipe"
    """The convention, as conf/convention/ names it: recipe | megatron_lm | bridge@0.6.2 |
    verl@0.9.1."""
    cu_seqlens_q: str = "padded"
    """padded: the padded offsets (the stream's layout) in cu_seqlens_q and cu_seqlens_q_padded,
    as verl and the recipe pass them | real: the real offsets in cu_seqlens_q, the padded ones
    in cu_seqlens_q_padded (Megatron-Bridge's packed SFT); megatron-core's MTP roll reads only
    cu_seqlens_q."""
    mtp_loss_mask: str = "passed"
    """passed: the model call hands the loss mask to megatron's MTP block | all_ones: it does
    not (Megatron-Bridge 0.6.2's gpt_step), and megatron-core's process_mtp_loss then counts
    every slot, padding included."""
    sources: list[ConventionSource] = field(default_factory=list)
    """Each choice of the convention with its upstream file:line (the conventions table's "why")."""

    def __post_init__(self) -> None:
        one_of("convention.cu_seqlens_q", self.cu_seqlens_q, CU_SEQLENS_Q)
        one_of("convention.mtp_loss_mask", self.mtp_loss_mask, MTP_LOSS_MASKS)


@dataclass
class LossSpikeConfig:
    """Spike detection by the step guard (recipe/training/guard.py)."""

    factor: float = 5.0
    """A step whose lm_loss, or grad_norm, exceeds factor x the median of that value over the
    previous `window` applied, unflagged steps is a spike (0: no spike detection)."""
    window: int = 10
    """How many previous steps the median is taken over; the first `window` steps are not
    judged."""
    action: str = "warn"
    """warn (log it in the step's record and the summary, apply the step) | skip_step (also
    leave the weights and optimizer state as they were) | stop (end the run with an error)."""

    def __post_init__(self) -> None:
        require(
            self.factor == 0 or self.factor > 1,
            f"trainer.loss_spike.factor must be > 1 (or 0: off), got {self.factor}",
        )
        positive("trainer.loss_spike.window", self.window)
        one_of("trainer.loss_spike.action", self.action, SPIKE_ACTIONS)


@dataclass
class MegatronEngineConfig:
    """megatron-core's own training machinery (trainer.engine=megatron)."""

    calculate_per_token_loss: bool = True
    """true: megatron sums per-token losses and divides every gradient once by the step's global
    token count (finalize_model_grads): exact at every layout. false: megatron's other mode, each
    rank's micro-batch loss divided by ITS token count and by the number of micro-batches, then
    averaged over dp x cp ranks: the trained model depends on the layout (see docs/megatron.md)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (and the gradient reduction) across data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during backward (megatron DDP)."""
    average_in_collective: bool = False
    """Average in the gradient collective instead of pre-scaling (megatron DDP); megatron
    refuses it with calculate_per_token_loss=true."""
    sync_mtp_position_embeddings: bool = True
    """At parallel.pp > 1 with mtp=on and learned absolute positions the last stage keeps its own
    copy of the position embeddings for the MTP block, whose gradient megatron never sums with
    the first stage's (docs/megatron.md). true: the recipe sums them after megatron's
    finalize_model_grads (the pp=1 result); false: megatron as released."""


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 500
    """Optimizer steps to train."""
    seed: int = 0
    """Seeds the model weights."""
    eval_every: int = 100
    """Evaluate every this many steps and at the end (0: only at the end)."""
    log_every: int = 1
    """Console refresh interval in steps (metrics.jsonl gets every step)."""
    progress_bar: bool = True
    """Show a progress bar on the console (rank 0)."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 (autocast, fp32 weights and optimizer)."""
    deterministic: bool = True
    """Deterministic kernels where the switches reach (megatron deterministic_mode, NVTE, cuBLAS,
    torch's deterministic algorithms in warn-only mode); on CUDA torch's flash attention backward
    (the torch backend's bf16 attention) stays non-deterministic: docs/gpu.md."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for `mfu` (default: known GPUs' data sheet; none on CPU)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: stop (log it, leave the weights at the last
    finite step and end the run with an error naming the step) | skip_step (log it, do not update,
    go on)."""
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """Loss and gradient-norm spikes: judged with the non-finite check, before the update."""
    collective_timeout_s: float = 300.0
    """How long any collective (on every process group, megatron's included) may wait for the
    other ranks before the job ends with an error: a stalled rank cannot hang the job longer."""
    checkpoint_every: int = 100
    """Write a checkpoint to <run dir>/checkpoints every this many steps and at the end
    (0: none). Checkpoints hold full tensors, so any parallel layout can resume them."""
    checkpoint_keep: int = 2
    """How many of the newest checkpoints stay; older ones are removed."""
    resume: str | None = None
    """null: start fresh | auto: continue from this run directory's newest checkpoint (or start
    fresh when it has none) | PATH: a checkpoint, or a run directory, to continue from."""
    allow_data_change: bool = False
    """Resume although an input file (data.data_files, data.tokenizer) differs from the one the
    checkpoint was written on (its size or SHA-256): the data position then points into the new
    files. Off: such a resume is refused, naming the file."""
    record_tokens: list[int] = field(default_factory=list)
    """Steps whose every predicted token's loss is written, with its sample, position, dp/cp rank
    and zigzag chunk, to <run dir>/tokens/step_N.npz (e.g. [1,10]); see --per-token."""
    trace_steps: list[int] = field(default_factory=list)
    """Steps whose every module output (per real token) and parameter gradient are written to
    <run dir>/trace/step_N.pt, for `python -m recipe.compare.diverge` (small models, tp=1)."""
    requeue: bool = False
    """After the checkpoint that SIGTERM/SIGUSR1 triggers, requeue the SLURM job (scontrol)."""
    engine: str = "megatron"
    """megatron: megatron-core's DistributedDataParallel, get_megatron_optimizer,
    OptimizerParamScheduler, get_forward_backward_func() schedules (1F1B at parallel.pp > 1) and
    finalize_model_grads, as Megatron-LM, verl and Megatron-Bridge train | reference: the recipe's
    own loop (torch AdamW, its gradient all-reduce and clipping), the independent reference
    megatron's engine is checked against (experiment=engine_parity); no pipeline parallelism."""
    megatron: MegatronEngineConfig = field(default_factory=MegatronEngineConfig)
    """Options of trainer.engine=megatron."""

    def __post_init__(self) -> None:
        one_of("trainer.precision", self.precision, PRECISIONS)
        require(
            self.engine != "recipe",
            "trainer.engine=recipe is now named trainer.engine=reference (the recipe's own loop); "
            "the default is trainer.engine=megatron",
        )
        one_of("trainer.engine", self.engine, ENGINES)
        require(
            not (self.megatron.calculate_per_token_loss and self.megatron.average_in_collective),
            "trainer.megatron.average_in_collective=true averages gradients in the collective, "
            "which megatron refuses with calculate_per_token_loss=true (it divides by the token "
            "count instead); set one of them to false",
        )
        require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"trainer.peak_tflops must be > 0 (or null for the device's data sheet), got "
            f"{self.peak_tflops}",
        )
        positive("trainer.max_steps", self.max_steps)
        positive("trainer.collective_timeout_s", self.collective_timeout_s)
        one_of("trainer.on_nonfinite", self.on_nonfinite, NONFINITE_ACTIONS)
        require(self.eval_every >= 0, f"trainer.eval_every must be >= 0, got {self.eval_every}")
        positive("trainer.log_every", self.log_every)
        require(
            self.checkpoint_every >= 0,
            f"trainer.checkpoint_every must be >= 0 (0: none), got {self.checkpoint_every}",
        )
        positive("trainer.checkpoint_keep", self.checkpoint_keep)
        for key in ("record_tokens", "trace_steps"):
            steps = getattr(self, key)
            require(
                all(isinstance(s, int) and 1 <= s <= self.max_steps for s in steps),
                f"trainer.{key} must list steps between 1 and trainer.max_steps="
                f"{self.max_steps}, got {list(steps)}",
            )
        require(
            self.resume is None or (isinstance(self.resume, str) and self.resume.strip()),
            f"trainer.resume must be null, auto or a path, got {self.resume!r}",
        )


@dataclass
class WandbConfig:
    mode: str = "offline"
    """disabled | offline (files in the run directory) | online."""
    project: str = "cp-recipe"
    """wandb project."""
    group: str | None = None
    """wandb group (a sweep sets its own when none is given)."""
    tags: list[str] = field(default_factory=list)
    """wandb tags."""

    def __post_init__(self) -> None:
        one_of("logger.wandb.mode", self.mode, WANDB_MODES)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CompareConfig:
    """How sweeps are judged (the parity report written at the end of `-m` runs)."""

    rtol: float = FP32_RTOL
    """Largest relative difference per step allowed against the baseline. 1e-5 suits fp32 on
    CPU; for bf16 on GPU use about 0.05 (Megatron-LM's functional-test tolerance) and read the
    correlation column."""
    baseline: str = "auto"
    """auto: per run, the cp=1, dp=1, tp=1 job with otherwise the same settings; or a job number
    of the sweep (e.g. "0") to compare every job with that one."""
    fail_exit_code: bool = True
    """A sweep whose parity report has a FAIL (or no report) exits 1, so scripts and CI notice."""
    noise_floor: str = "auto"
    """auto | twin | fixed: each step's tolerance is max(rtol, noise_margin x the baseline's own
    fp32 drift by that step), the drift learned from the baseline's noise twin (trained with the
    sequences of each micro-batch reversed). auto: the twin is trained, where the report is made,
    only when a run fails at rtol; twin: the baseline job trains it right after itself (on a
    cluster, on the baseline's own node); fixed: rtol on every step."""
    noise_margin: float = NOISE_MARGIN
    """How many times the baseline's own drift a run may differ by (see docs/comparing-runs.md)."""
    anchor_every: int = ANCHOR_EVERY
    """A run longer than this keeps its state every this many steps and compare.anchor_steps
    before its end (<run dir>/anchors/): where the noise floor has widened a run's tolerance, the
    comparison trains the run's layout from each of its baseline's anchors for
    compare.anchor_steps steps and judges them at rtol and per token (0: no anchors)."""
    anchor_steps: int = ANCHOR_STEPS
    """Steps both layouts take from an anchor's state (the first shows a wrong gradient in
    grad_norm, the second its update in the loss)."""

    def __post_init__(self) -> None:
        positive("compare.rtol", self.rtol)
        positive("compare.noise_margin", self.noise_margin)
        one_of("compare.noise_floor", self.noise_floor, NOISE_FLOORS)
        require(
            self.anchor_every >= 0,
            f"compare.anchor_every must be >= 0 (0: no anchors), got {self.anchor_every}",
        )
        positive("compare.anchor_steps", self.anchor_steps)
        require(
            self.anchor_every == 0 or self.anchor_steps < self.anchor_every,
            f"compare.anchor_steps={self.anchor_steps} must be below compare.anchor_every="
            f"{self.anchor_every}: the steps taken from one anchor end before the next anchor",
        )
        require(
            self.baseline == "auto" or str(self.baseline).isdigit(),
            f"compare.baseline={self.baseline!r}: use auto or a job number such as 0",
        )


@dataclass
class MutantConfig:
    """A deliberately broken copy of the CP/MTP/loss path (recipe/training/mutants.py): what the
    training mutation score (experiment=training_mutants) proves the verdict catches."""

    name: str = "none"
    """none (train correctly) or a mutant of the catalogue (docs/mutants.md)."""
    onset: int = 1
    """The first step the mutant is active at (1: from the start; a late step: a bug that
    starts late in a long run)."""

    def __post_init__(self) -> None:
        one_of("mutant.name", self.name, MUTANTS)
        positive("mutant.onset", self.onset)
