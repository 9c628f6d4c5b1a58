# kvlab: `make run` runs the workbook, `make test` runs the tests; both set up .venv first.
#
# Variables (the environment wins over these defaults, so CI can pass TORCH):
#   PYTHON      interpreter that creates the venv                    (python3)
#   TORCH       the torch requirement, installed before kvlab        (torch>=2.4)
#               e.g. TORCH='torch==2.13.0' for a CPU build whose wheel is on local disk
#   CPU         CPU=1: install torch's CPU build (a venv of about 2.6 GB, against about 6 GB with the
#               default CUDA build on Linux) from TORCH_INDEX
#   TORCH_INDEX the package index torch comes from (with CPU=1: PyTorch's CPU index)
#   PY_VERSION  Python version of the target of `make wheelhouse`    (3.12)
#   PLATFORM    platform tag(s) of the target of `make wheelhouse`   (manylinux_2_28_x86_64)
#   EXTRAS      kvlab extras to add to the wheelhouse, e.g. dev,nixl (none)
#   PYTEST_ARGS extra pytest arguments for `make test`, e.g. -k results

PYTHON      ?= python3
TORCH       ?= torch>=2.4
CPU         ?=
TORCH_INDEX ?= $(if $(CPU),https://download.pytorch.org/whl/cpu,)
VENV        ?= .venv
PY_VERSION  ?= 3.12
PLATFORM    ?= manylinux_2_28_x86_64
EXTRAS      ?=
WHEELHOUSE  ?= wheelhouse
PYTEST_ARGS ?=

BIN   := $(VENV)/bin
# Set-up reruns only when pyproject.toml (the dependency list) changes.
STAMP := $(VENV)/.kvlab-installed

.PHONY: help venv run test lab wheelhouse platform-flags clean distclean

help:
	@echo "make run         set up .venv, then run every notebook (kvlab run-all)"
	@echo "make test        set up .venv, then run the test suite"
	@echo "make lab         JupyterLab on notebooks/"
	@echo "make wheelhouse  wheels for an air-gapped node (PY_VERSION=$(PY_VERSION) PLATFORM=$(PLATFORM))"
	@echo "make clean       remove build outputs (distclean: the venv too)"

venv: $(STAMP)

# torch first and on its own, so that TORCH decides which build is installed; kvlab's own
# torch>=2.4 is then already satisfied and pulls nothing more. Nothing is installed globally.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )"$(TORCH)"
	$(BIN)/python -m pip install -e '.[dev]'
	# notebooks stay committed without outputs: nbstripout as this clone's git filter, so saving a notebook in
	# JupyterLab and committing it keeps outputs out of git. Only the filter is configured here; which files it
	# applies to is .gitattributes' business (`nbstripout --install` would add its own attributes file, which
	# outranks .gitattributes and would strip the executed notebooks that are runs' records under data/)
	if git rev-parse --git-dir >/dev/null 2>&1; then \
	  git config filter.nbstripout.clean '"$(abspath $(BIN))/python" -m nbstripout' && \
	  git config filter.nbstripout.smudge cat && git config filter.nbstripout.required true && \
	  git config diff.ipynb.textconv '"$(abspath $(BIN))/python" -m nbstripout -t'; fi
	touch $@

run: $(STAMP)
	$(BIN)/kvlab run-all

# no test reads input: stdin is /dev/null, so a runner that starts make with stdin closed (CI) changes nothing
test: $(STAMP)
	@$(BIN)/python tests/browser.py
	$(BIN)/python -m pytest $(PYTEST_ARGS) < /dev/null

# JupyterLab refuses to start as root without --allow-root (containers and cloud notebooks run as root)
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# pip matches --platform tags literally, but a node with glibc 2.28 also runs wheels built for any
# older glibc (manylinux_2_17 = manylinux2014, ...), which is how most packages ship: pass them all.
PLATFORM_FLAGS = $(shell for p in $(PLATFORM); do \
	printf -- '--platform %s ' "$$p"; \
	case "$$p" in (manylinux_2_*_*) \
		glibc=$$(echo "$$p" | cut -d_ -f3); arch=$$(echo "$$p" | cut -d_ -f4-); \
		for i in $$(seq $$((glibc - 1)) -1 5); do printf -- '--platform manylinux_2_%s_%s ' "$$i" "$$arch"; done; \
		if [ "$$glibc" -ge 17 ]; then printf -- '--platform manylinux2014_%s ' "$$arch"; fi; \
		if [ "$$glibc" -ge 12 ]; then printf -- '--platform manylinux2010_%s ' "$$arch"; fi; \
		printf -- '--platform manylinux1_%s ' "$$arch";; \
	esac; \
done)

# On the air-gapped node: pip install --no-index --find-links wheelhouse kvlab
wheelhouse: $(STAMP)
	rm -rf $(WHEELHOUSE)
	mkdir -p $(WHEELHOUSE)
	$(BIN)/python -m pip wheel --no-deps --wheel-dir $(WHEELHOUSE) .
	$(BIN)/python -m pip download --dest $(WHEELHOUSE) --only-binary=:all: \
		--python-version $(PY_VERSION) $(PLATFORM_FLAGS) \
		"$(TORCH)" "$$(ls $(WHEELHOUSE)/kvlab-*.whl)$(if $(EXTRAS),[$(EXTRAS)])"
	@echo "$(WHEELHOUSE)/ is ready: copy it to the node, then pip install --no-index --find-links $(WHEELHOUSE) kvlab"

platform-flags:
	@echo $(PLATFORM_FLAGS)

clean:
	rm -rf build dist $(WHEELHOUSE) *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
