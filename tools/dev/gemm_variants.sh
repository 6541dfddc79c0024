#!/bin/bash
# Builds variants of the library that differ in one CUDA source compiled with extra defines, on
# top of an existing build (make CUDA_ARCHS=90 first): build-<name>/libbitnet.so for each
# NAME=SOURCE:DEFINES argument, e.g.  tools/dev/gemm_variants.sh x=gemv_w2a8:-DBN_GEMM_MIN_TOKENS=2
set -e
for spec in "$@"; do
    name=${spec%%=*}; rest=${spec#*=}; src=${rest%%:*}; defines=${rest#*:}
    rm -rf build-$name && cp -r build build-$name
    flags=$(make -n -B CUDA_ARCHS=90 build/obj-cuda/cuda/$src.cu.o | grep "^[^ ]*nvcc " | sed "s#-o build/#-o build-$name/#; s#-MMD -MP##")
    $flags $defines
    make -s CUDA_ARCHS=90 BUILD_DIR=build-$name
done
