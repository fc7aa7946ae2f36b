"""NeMo Automodel (PyPI `nemo-automodel`): its THD packer and its MTP shift before CP, read from
the released wheel by path and checked against the ground truths of `packer_truth.py` and
`mtp_truth.py`.

Neither function is a per-rank CP function, so neither fits the zigzag contract: each has its own
reference, written without the library (`packer_truth.py`, `mtp_truth.py`, which their
reproducers embed).

`pack_dataset` (`nemo_automodel/components/datasets/llm/packed_sequence.py`) packs tokenized
samples into fixed-length rows for the THD path (`ThdPackingConfig.build` in
`components/datasets/loader.py` calls it with the CP size; `packed_sequence_thd_collater` stacks the
rows). Its samples' `labels` are already shifted (the dataset's convention: the label of position
p is the next token), so the truth is that each sample's labels travel with its tokens, -100 where
the sample's `loss_mask` is 0. A case is (lengths, cp 1/2/4/8, pack size); the pack size is drawn
both aligned to 2*cp and not, since the function takes any size. The truth refuses a pack size
that is not a multiple of lcm(2*cp, pad_to_multiple_of): fixed-length packs could not keep every
span a multiple of 2*cp. A release that raises there is right; one that packs is judged against
the packing a correct packer would build if it went on.
- drawn: `max_packs` (None, 1, 2, 3), `padding_idx` (0, or an id no token or label has: a padding
  slot is told by its token id), `drop_long_samples`, `pad_to_multiple_of` (1, 2, 3, 8; the
  function refuses a pack size it does not divide, and so does the truth); and two options of the
  input: `input_form` (an HF `datasets.Dataset`, what the loader passes, or a list of dicts, which
  the signature also accepts) and `loss_mask` (samples with a `loss_mask` column, 0 on their first
  third, or none).
- fixed: `split` = None (it only picks an entry of a `DatasetDict`; the case is a `Dataset`);
  `dataset`, `packed_sequence_size` and `cp_size` are the case.
- stubs: none. The file imports torch and `datasets` (installed here; `Dataset.from_dict` builds
  its result) and nothing else.

`prepare_mtp_context_parallel_inputs` (`nemo_automodel/components/models/common/mtp/mtp.py`)
shifts each MTP depth's token ids, positions, targets and valid masks on the unsharded batch; the
recipes then shard every result with the CP sharder (`recipes/llm/train_ft.py`,
`_forward_backward_step`). A case is (lengths, cp 2/4/8): the documents packed as
`pack_dataset` packs them (each padded to a multiple of 2*cp, a row's last document absorbing
the row's tail), labels the next token, padding labels the ignore index. The truth is checked on
every slot, named by its rank and local slot in the zigzag split the THD sharder applies.
- drawn: `num_depths` (1-4; it has no default: the default mode uses 1, DeepSeek-V3's one
  MTP module), `ignore_index` (-100, -1; the batch's padding labels use it too, as the loss's own
  ignore index must); and options of the batch: `rows` (1 or 2 packs stacked), `boundaries` (how
  the batch says where documents are: `seq_lens_padded` [rows, documents] with -1000 sentinels,
  as `packed_sequence_thd_collater` makes it; `cu_seqlens_padded`, one row; `seq_idx`, a span id
  per slot; `_packed_seq_ids`, NEAT's document ids with 0 on padding) and `positions` (per row, as
  the collater gives them; shared [1, S]; M-RoPE [3, rows, S]; or none, which the function
  materializes as 0..S-1 for the main model and MTP alike).
- fixed: `batch` is the case. Real offsets (`cu_seqlens`) are not drawn: they describe an
  unpadded stream only, and the function refuses them on a padded one (a documented ValueError),
  while a CP stream is padded.
- stubs: none (the file imports only torch).

Negative controls (one line of the release's own source, mutated): the packer pads each sample
one token more than the span `_pad_pack` records (`cp_padding_amount + 1`); the MTP shift compares
each slot's document id with that of the slot `depth - 1` ahead instead of `depth` ahead
(`torch.roll(seq_idx, shifts=-depth + 1, ...)`), so a target crosses into the next document.

Where it lives (recipe/checks/upstream/libraries/nemo_automodel/): `packer_truth.py` and
`mtp_truth.py` the two references (each with the call of the release's function that its
reproducers ship), `reproducer.py` the reproducer's loading of the wheel and its script,
`targets.py` the two checked targets, their options, negative controls and reproducers.
"""

from recipe.checks.upstream.kit.checked import Library
from recipe.checks.upstream.libraries.nemo_automodel.targets import (
    DISTRIBUTION,
    MTP_SHIFT,
    PACK_DATASET,
)

LIBRARY = Library(DISTRIBUTION, (PACK_DATASET, MTP_SHIFT), releases=("0.7.0",))
