# The two set-up commands of the README. Both install into .venv first (reused when unchanged).
.PHONY: install demo test lint

install:
	@bash scripts/install.sh

demo: install
	.venv/bin/bertforge demo --output bertforge-demo

# Serial: with two pytest-xdist workers (-n 2 --dist loadscope --no-loadscope-reorder, 13.5 min
# here instead of ~20) a clean clone's first two Ray starts, at once on a cold 2-core machine,
# missed Ray's fixed 30 s node start-up wait and failed the demo and pre-flight modules.
test: install
	.venv/bin/python -m pytest -q

lint: install
	.venv/bin/ruff check .
