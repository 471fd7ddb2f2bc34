#!/usr/bin/env bash
# Library paths of the GPU test machine (H200, driver 580 = CUDA 13.0, NCCL 2.28.9), for the
# executables gpu/build.sh puts in target-gpu/ (it copies this file there as device-env.sh;
# FSDP_DEVICE_ENV names another file for another machine). Source it there, then run:
#
#   . target-gpu/device-env.sh && gpu/check.sh
#
# That machine has no CUDA toolkit of its own for us: the CUDA 13.0 user-space libraries
# (cuBLAS/cuBLASLt 13.1, cudart 13.0, cuRAND, NVRTC 13.0) and NCCL come with its PyTorch
# install; the driver's libcuda.so.1 is where the NVIDIA container runtime puts it. The
# executables name the libraries by soname (libcuda.so.1, libcublas.so.13, libnccl.so.2, ...).
# Instant; changes only the environment.
_fsdp_nv=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export LD_LIBRARY_PATH="$_fsdp_nv/cu13/lib:$_fsdp_nv/nccl/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
unset _fsdp_nv
