"""yunchang's sequence-parallel shard functions, loaded from its PyPI wheel.

`zigzag_extract_local`, `stripe_extract_local` and `basic_extract_local`
(`yunchang/comm/extract_local.py`) cut one dense tensor `[batch, seqlen, ...]` into the shard
one rank of a sequence-parallel group feeds `LongContextAttention`. That group is ring x ulysses,
built by `set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size, use_ulysses_low)`
(`yunchang/globals.py`). The attention (`yunchang/hybrid/attn_layer.py`) first all-to-alls q, k, v
over the ulysses group, which concatenates the ulysses ranks' shards in group-rank order
(`comm/all_to_all.py`, `all_to_all_4D`), then runs ring attention over the ring group, whose
ring rank r must then hold:
- basic (`ring/ring_flash_attn.py`): positions [r*s/rd, (r+1)*s/rd), the contiguous block r;
- zigzag (`ring/zigzag_ring_flash_attn.py`): chunks r and 2*rd-1-r of 2*rd equal chunks (its
  causal steps use the first half of a peer's k/v and the second half of its own q);
- stripe (`ring/stripe_flash_attn.py`): positions r, r+rd, r+2rd, ... (a peer's k/v is causal
  with the diagonal when it sits at a lower ring rank, without it otherwise).
So the shard of a rank with ring rank r and ulysses rank u is the u-th of ud equal consecutive
pieces of ring rank r's positions: the ground truth here, written from that reading alone.
A length the layout cannot split (basic and stripe: not a multiple of rd*ud; zigzag: of
lcm(2*rd, rd*ud), or of ud when rd = 1) is judged against the sequence padded at its tail to
the next multiple: the functions take no padding, so a raise is RAISES, a real element on no rank
LOST, one in the wrong slot (or on two ranks) MISPLACED, and ranks holding unequal shards whose
real elements all sit right PADDING (only the missing padding differs; yunchang's exchanges then
get shards of unequal length).

What a case draws: batch 1-2, the sequence length, trailing feature axes (none, one or two),
and (ring degree, ulysses degree) with 2 <= rd*ud <= 8. Every element of the value is a unique
id, so one id names its batch row, position and feature, and a misplaced element cannot match
by accident (the functions have no position output: an id's position is where it came from).

Options (the drawn ones, with their defaults first):
- `use_ulysses_low` (True, False): set_seq_parallel_pg's choice of which degree gets the
  consecutive ranks; the release's own set_seq_parallel_pg builds the groups, which must agree
  with the checker's model of them (ulysses-low: u = g % ud, r = g // ud; else r = g % rd,
  u = g // rd), or the check refuses.
- `dim` (1, 2), zigzag only: the axis it chunks. With dim=2 the value is laid out
  [batch, feature, seqlen, ...] (the sequence on the chunked axis, a feature axis of 1 added to a
  [batch, seqlen] case) and its shard is expected in the same layout.
Fixed: `value` (the drawn tensor); `rank` (each rank g of the group in turn) and `world_size`
(rd*ud) as yunchang's own test passes them (test/test_hybrid_attn.py:201-203), with dp = 1: the
functions lay out one sequence-parallel group, and set_seq_parallel_pg gives every dp group the
same layout offset by dp_rank * rd * ud; `rd`, `ud` the case's degrees (basic takes them in
**kwargs and reads neither); `*args`/`**kwargs` nothing more (the functions read nothing else).
An option of the functions or of set_seq_parallel_pg not named here refuses the check.

Stand-ins, no stubs of called code: `yunchang.globals` is replaced while extract_local.py loads by
a module holding only PROCESS_GROUP, the release's own singleton from its globals.py (loaded by
path, its optional kernel imports made to fail: see OPTIONAL_KERNELS); set_seq_parallel_pg's
`torch.distributed.new_group` returns a group object listing its ranks sorted, as torch's
new_group numbers them; the functions' `dist.get_rank(group)` / `get_world_size(group)` answer
from those lists for the rank being played. One process plays every rank.

Where it lives (recipe/checks/upstream/libraries/yunchang/): `truth.py` the ground truth and the
comparison with it, `ranks.py` the stand-ins and the rank runner, both self-contained since
`inspect.getsource` ships them into every reproducer; `reproducer.py` the reproducer's loading of
the wheel and its script; `targets.py` the three checked functions, their options, negative
controls and reproducers.
"""

from recipe.checks.upstream.kit.checked import Library
from recipe.checks.upstream.libraries.yunchang.targets import LAYOUTS, ExtractTarget

DISTRIBUTION = "yunchang"

LIBRARY = Library(
    DISTRIBUTION,
    tuple(ExtractTarget(name) for name in LAYOUTS),
    releases=("0.6.4",),
)
