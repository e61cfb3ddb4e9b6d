#!/bin/bash
# The start by host load: OLD = .ab_old (1c30163, the convoy start for client processes), NEW =
# this tree (not waiting while the host's CPUs have room). Heterogeneous decoders, GPU executor.
set -u
source docs/benchmarks/batching_h200/scripts/common.sh
HET="--scenarios inference --policies opportunistic immediate"
run het_new . 85 $HET
run het_old .ab_old 85 $HET
uptime
