#!/usr/bin/env bash
# One rank of an `fsdp launch --nproc N` job whose N processes share ONE GPU (the H200 test
# machine has one): every process uses device 0 (`LOCAL_RANK=0`) and a distinct NCCL host id
# (`NCCL_HOSTID=fsdp-<RANK>`), so NCCL connects the ranks over sockets instead of refusing two
# ranks on one device ("Duplicate GPU detected"); use with NCCL_SOCKET_IFNAME=lo
# NCCL_IB_DISABLE=1. This is what FSDP_NCCL_HOSTID_PER_RANK does inside the conformance tests
# (NcclLauncher::from_env), done from outside so any `fsdp train --device cuda --backend nccl`
# runs this way. Tests only (slow loopback transport).
#
#   FSDP_BIN=target-gpu/fsdp fsdp launch --nproc 2 --program gpu/one_gpu_rank.sh -- train ...
set -euo pipefail
: "${RANK:?one_gpu_rank.sh runs under fsdp launch (RANK is not set)}"
: "${FSDP_BIN:?set FSDP_BIN to the fsdp executable}"
export LOCAL_RANK=0 NCCL_HOSTID="fsdp-$RANK"
exec "$FSDP_BIN" "$@"
