#!/bin/bash
# A/B on the H200 host, executor on the GPU, client processes: OLD = .ab_old (c5dc90d, before the
# at-once rule change), NEW = this tree. Heterogeneous decoders (3 policies) and mixed (alone /
# beside fine-tuning), single runs, interleaved. Run from the repository root.
set -u
source docs/benchmarks/batching_h200/scripts/common.sh
nproc; nvidia-smi -L
HET="--scenarios inference --policies opportunistic immediate lockstep"
MIX="--scenarios inference_alone inference_with_finetune --policies opportunistic"
run het_old .ab_old 120 $HET
run het_new . 120 $HET
run mix_old .ab_old 100 $MIX
run mix_new . 100 $MIX
uptime
