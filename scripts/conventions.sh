#!/usr/bin/env bash
# The conventions table of docs/conventions.md, from scratch: does each framework's way of calling
# megatron-core train the cp=1 model? Five sweeps (about 80 small jobs, ~25 min on 2 CPU cores),
# then one table. `make conventions` runs it; usage: scripts/conventions.sh [OUT_DIR] [--write-docs]
#   main       convention x cp 1/2/4 x mtp off/on (experiment=conventions)
#   pipeline   pp 1/2 with MTP and learned positions, where the embedding groups act, with and
#              without the MTP position-embedding sync (the recipe without it: its own control)
#   *_ablation each framework's choices set back to the recipe's one at a time, so the table says
#              which choice accounts for each divergence
# A sweep with a FAIL exits 1 by design (compare.fail_exit_code): the table is the verdict.
set -uo pipefail
out=${1:-outputs/conventions}
shift || true
python=${PYTHON:-python}

sweep() {
    local name=$1
    shift
    echo "== $name: python train.py -m experiment=conventions $*"
    "$python" train.py -m experiment=conventions "hydra.sweep.dir=$out/$name" \
        trainer.progress_bar=false "$@" >"$out/$name.log" 2>&1
    echo "   exit $? (1: some FAIL or RAISES, expected), log: $out/$name.log"
}

mkdir -p "$out"
sweep main
sweep pipeline convention=recipe,bridge@0.6.2 "cp='1'" parallel.pp=1,2 mtp=on \
    model.position_embedding_type=learned_absolute \
    trainer.megatron.sync_mtp_position_embeddings=true,false
sweep bridge_ablation convention=bridge@0.6.2 mtp=on convention.cu_seqlens_q=real,padded \
    convention.mtp_loss_mask=all_ones,passed mtp.scaling=upstream,exact
sweep verl_ablation convention=verl@0.9.1 mtp=on mtp.scaling=upstream,exact \
    cp.preprocess=verl@0.9.1,index
sweep megatron_lm_ablation convention=megatron_lm mtp=on mtp.scaling=upstream,exact \
    trainer.megatron.calculate_per_token_loss=false,true
"$python" -m recipe.compare.conventions "$out"/main "$out"/pipeline "$out"/*_ablation "$@"
