# The two set-up commands of the README. Both install into .venv first (reused when unchanged).
.PHONY: install demo test lint

install:
	@bash scripts/install.sh

demo: install
	.venv/bin/bertforge demo --output bertforge-demo

test: install
	.venv/bin/python -m pytest -q

lint: install
	.venv/bin/ruff check .
