# Builds build/libbitnet.so: the CUDA backend with nvcc when it is found, else a CPU-only library.
#   make                      the default GPU architectures (sm_75, sm_80, sm_90 + PTX)
#   make CUDA_ARCHS=90        only sm_90 (faster builds for one machine)
#   make BITNET_CPU_ONLY=1    the CPU-only library even where nvcc exists
#   make install PREFIX=/usr/local   the library (with its SONAME links) and bitnet.h, for C users
#   make clean
#   make demo / make test     set up .venv, build, and run the main job / the tests (see README);
#                             make test also runs tier 1 against the library built with ASan + UBSan

BUILD_DIR   ?= build
ifeq ($(MAKELEVEL),0)
MAKEFLAGS   += -j$(shell nproc 2>/dev/null || echo 2)
endif
LIB         := $(BUILD_DIR)/libbitnet.so
# The version lives in bitnet.h (BITNET_VERSION_*). While the major version is 0 any minor version
# may change the ABI, so the SONAME carries both.
VERSION_OF   = $(shell sed -n 's/^\#define BITNET_VERSION_$(1) \([0-9]*\)$$/\1/p' native/include/bitnet.h)
VERSION     := $(call VERSION_OF,MAJOR).$(call VERSION_OF,MINOR).$(call VERSION_OF,PATCH)
SONAME      := libbitnet.so.$(call VERSION_OF,MAJOR).$(call VERSION_OF,MINOR)
# sm_86 and sm_89 GPUs run sm_80's machine code (a cubin runs on later minor versions of its major
# one; no kernel has code of its own for them); CUDA_ARCHS="75 80 86 89 90" adds theirs. Newer GPUs
# JIT-compile the last architecture's PTX.
CUDA_ARCHS  ?= 75 80 90
CC          ?= cc
PYTHON      ?= python3

NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) \
                    $(wildcard $(CUDA_HOME)/bin/nvcc) $(wildcard /usr/local/cuda/bin/nvcc))
ifeq ($(BITNET_CPU_ONLY),1)
NVCC :=
endif

C_SRCS    := $(wildcard native/src/*.c native/src/cpu/*.c)
CU_SRCS   := $(wildcard native/src/cuda/*.cu)
CPPFLAGS  := -Inative/include -Inative/src
OPT       ?= -O3
SANITIZE  ?=
CFLAGS    := $(OPT) $(SANITIZE) -std=gnu11 -fPIC -fopenmp -Wall -Wextra -Wshadow
# -z nodelete: once loaded, the library (and libgomp with it) stays for the life of the process, so
# that no loader's unload can pull the code from under OpenMP worker threads that are still running.
LDFLAGS   := -shared -fopenmp $(SANITIZE) -Wl,--version-script=native/bitnet.map -Wl,--no-undefined \
             -Wl,-soname,$(SONAME) -Wl,-z,nodelete

ifneq ($(NVCC),)
BACKEND   := cuda
# nvcc may be a wrapper script: ask it where its toolkit is.
CUDA_ROOT := $(abspath $(shell $(NVCC) --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ TOP=//p'))
CPPFLAGS  += -DBITNET_HAVE_CUDA -I$(CUDA_ROOT)/include
# sm_86 and sm_89 machine code is compiled from sm_80's PTX: one front-end pass (cicc) serves the
# three, and ptxas still schedules each one's code.
virtual_arch = $(if $(filter 86 89,$(1)),80,$(1))
PTX_ARCH  := $(call virtual_arch,$(lastword $(CUDA_ARCHS)))
GENCODE   := $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(call virtual_arch,$(a)),code=sm_$(a)) \
             -gencode=arch=compute_$(PTX_ARCH),code=compute_$(PTX_ARCH)
NVCCFLAGS ?= -O3
# --threads 0: each nvcc compiles its architectures in parallel, one thread per CPU (a file's
# architectures are most of the build; on 2 cores it took the build from 9.9 to 5.3 minutes when it
# was measured). The default build took 7.1 minutes on 2 cores on 2026-12-01 (8.9 with sm_86 and
# sm_89), rmsnorm.cu's template instances the largest share: keep their number down
# (docs/log/2026-12-01.md#2026-12-01-4).
NVCCFLAGS += -std=c++17 $(GENCODE) -Xcompiler -fPIC,-Wall,-Wextra \
             --expt-relaxed-constexpr -Wno-deprecated-gpu-targets --threads 0
LDLIBS    += -L$(CUDA_ROOT)/lib64 -L$(CUDA_ROOT)/targets/x86_64-linux/lib \
             -lcudart_static -lstdc++ -lrt -ldl -lpthread
else
BACKEND   := cpu
CU_SRCS   :=
endif
LDLIBS += -lm

OBJ_DIR := $(BUILD_DIR)/obj-$(BACKEND)
C_OBJS  := $(C_SRCS:native/src/%.c=$(OBJ_DIR)/%.o)
CU_OBJS := $(CU_SRCS:native/src/%.cu=$(OBJ_DIR)/%.cu.o)

.PHONY: all clean install demo test asan asan-test
all: $(LIB)
ifeq ($(BACKEND),cpu)
	@echo "libbitnet: nvcc not found (or BITNET_CPU_ONLY=1): built the CPU-only library $(LIB)"
endif

# The backend and flags are recorded so that switching them recompiles and relinks the library.
# $(call record,FILE,TEXT) rewrites FILE only when TEXT changed.
record = @mkdir -p $(dir $(1)); echo "$(2)" | cmp -s - $(1) || echo "$(2)" > $(1)
$(BUILD_DIR)/config.$(BACKEND): FORCE
	$(call record,$@,$(CC) $(CFLAGS) $(NVCC) $(NVCCFLAGS))
$(BUILD_DIR)/config.link: FORCE
	$(call record,$@,$(BACKEND) $(CC) $(LDFLAGS) $(LDLIBS))

# The link named by the SONAME lets a C program linked with -Lbuild -lbitnet run from build/.
$(LIB): $(C_OBJS) $(CU_OBJS) native/bitnet.map $(BUILD_DIR)/config.link
	$(CC) $(LDFLAGS) -o $@ $(C_OBJS) $(CU_OBJS) $(LDLIBS)
	ln -sf libbitnet.so $(BUILD_DIR)/$(SONAME)

$(OBJ_DIR)/%.o: native/src/%.c $(BUILD_DIR)/config.$(BACKEND)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

# Hopper-only kernels (wgmma) are built for sm_90a alone, whatever CUDA_ARCHS says; their launchers
# run them only on compute capability 9.0.
$(OBJ_DIR)/cuda/gemm_w2a8_sm90.cu.o $(OBJ_DIR)/cuda/attention_prefill_sm90.cu.o $(OBJ_DIR)/cuda/gemv_bf16_sm90.cu.o: GENCODE := -gencode=arch=compute_90a,code=sm_90a

# Compiling every architecture takes minutes on a small machine: say so, and how to skip it, once
# before the CUDA objects are compiled.
$(OBJ_DIR)/%.cu.o: native/src/%.cu $(BUILD_DIR)/config.$(BACKEND) | $(OBJ_DIR)/cuda-notice
	@mkdir -p $(dir $@)
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(OBJ_DIR)/cuda-notice: $(BUILD_DIR)/config.$(BACKEND)
	@mkdir -p $(dir $@)
	@echo "libbitnet: nvcc found: compiling the CUDA backend for GPU architecture(s) $(CUDA_ARCHS)," \
	    "minutes of work on a small machine.$(if $(shell nvidia-smi -L 2>/dev/null),, No NVIDIA GPU" \
	    "is visible here.) To skip CUDA: make BITNET_CPU_ONLY=1$(if $(word 2,$(CUDA_ARCHS)),; for" \
	    "one architecture: make CUDA_ARCHS=90)."
	@touch $@

# C users: make install PREFIX=... [DESTDIR=...] installs lib/libbitnet.so.$(VERSION) with the
# links libbitnet.so.MAJOR.MINOR (the SONAME) and libbitnet.so, and include/bitnet.h.
PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
install: all
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR)
	install -m 755 $(LIB) $(DESTDIR)$(LIBDIR)/libbitnet.so.$(VERSION)
	ln -sf libbitnet.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libbitnet.so
	install -m 644 native/include/bitnet.h $(DESTDIR)$(INCLUDEDIR)/bitnet.h

clean:
	rm -rf $(BUILD_DIR)

# A virtual environment with the package (editable) and what the tests need.
VENV ?= .venv
TIER ?= auto
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed all
	$(VENV)/bin/python -m bitnet_ffi demo

test: $(VENV)/.installed all
	$(VENV)/bin/python ci/tiers.py --tier $(TIER)
	$(MAKE) asan-test

# The CPU library under AddressSanitizer and UndefinedBehaviorSanitizer (any report is fatal), and
# tier 1 run against it. Python itself is not instrumented, so the ASan runtime is preloaded and
# leak detection (which would report the interpreter's own) is off.
ASAN_DIR := build-asan
asan:
	$(MAKE) BUILD_DIR=$(ASAN_DIR) BITNET_CPU_ONLY=1 OPT="-O1 -g -fno-omit-frame-pointer" \
	    SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all"

asan-test: $(VENV)/.installed asan
	BITNET_LIB=$(CURDIR)/$(ASAN_DIR)/libbitnet.so LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) \
	    $$($(CC) -print-file-name=libubsan.so)" ASAN_OPTIONS=detect_leaks=0 \
	    UBSAN_OPTIONS=print_stacktrace=1 $(VENV)/bin/python -m pytest -m cpu -q -p no:cacheprovider -n auto

FORCE:

-include $(C_OBJS:.o=.d) $(CU_OBJS:.o=.d)
