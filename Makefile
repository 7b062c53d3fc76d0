# The two set-up commands of the README. Both install into .venv first (reused when unchanged).
.PHONY: install demo test lint

install:
	@bash scripts/install.sh

# The demo needs neither Dataflow's client (the dataflow extra) nor the tests' tools; `make test`
# later adds what it lacks.
demo:
	@bash scripts/install.sh dev
	.venv/bin/bertforge demo --output bertforge-demo

# Two pytest-xdist workers, a whole module each at a time, the longest modules first
# (tests/conftest.py): one module's Ray start-up waits overlap another's compute. Their first
# Ray starts come at once; local_ray.start retries one that misses Ray's fixed 30 s wait.
test: install
	.venv/bin/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder

lint: install
	.venv/bin/ruff check .
