#!/bin/bash
# Second part of the A/B (device_ab2.sh): mixed with the convoy fixed beside the adaptive rule, new
# and old, then the heterogeneous case again on the new tree with the convoy fixed too.
set -u
source docs/benchmarks/batching_h200/scripts/common.sh
MIX="--scenarios inference_alone inference_with_finetune --policies opportunistic opportunistic-convoy"
run mix2_new . 130 $MIX
run mix2_old .ab_old 130 $MIX
run het2_new . 120 --scenarios inference --policies opportunistic immediate lockstep opportunistic-convoy
uptime
