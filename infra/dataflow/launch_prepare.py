"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE in infra/dataflow/Dockerfile).

The template launcher runs `python launch_prepare.py --input=... --output=...` with the
template's parameters as flags; this runs the installed package's Beam job on them through the
job's own command line (`bertforge.pipelines.prepare.main`: parsed once, the job's flags and
Beam's), which the CLI's prepare command wraps in its guard for local outputs. It lives outside
the package: running a module file of the package as a script would put that package folder first
on sys.path and load a second copy of the module as `__main__`.
"""

import json
import logging

from bertforge.pipelines.prepare import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(json.dumps(main(), indent=2))
