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
import sys

from bertforge.pipelines.prepare import main
from bertforge.pipelines.prepare_options import NO_WAIT_FLAGS

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:]
    # The launcher's work ends once the job exists: waiting for the job's hours would hold the
    # launcher VM, and its launch timeout, for all of them. The job reports itself in the
    # Dataflow console; its manifest, written last, says it is done.
    if not any(flag in argv for flag in NO_WAIT_FLAGS):
        argv.append(NO_WAIT_FLAGS[0])
    print(json.dumps(main(argv), indent=2))
