"""`bertforge submit`: run a command (usually `bertforge train ...`) as a Ray job on a cluster.

Uses the Ray Jobs API (`JobSubmissionClient`): the job's code travels as a working directory
(with excludes) or lives in a container image; logs are followed until the job ends and the
job's final status becomes the exit code, so a scheduler or CI can act on it.

When the working directory is a bertforge checkout, the package setuptools builds from it also
travels, as `bertforge` (runtime_env `py_modules`), so the job runs the uploaded code rather than
the bertforge installed on the cluster: the uploaded working dir goes on the job's PYTHONPATH as
it is, where its `training/` is `training`, never `bertforge.training`. Ray puts a py_modules
directory's parent first on PYTHONPATH in the driver and every worker, ahead of site-packages,
and `bertforge` is a namespace package (no `__init__.py`, here or installed), so
`bertforge.training` is imported from the uploaded portion.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import shlex
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from bertforge.cluster.launch.checkout import built_package, package_folders
from bertforge.training.errors import UserInputError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray's own variables for the Jobs API's address, in the order its client reads them
# (`ray.dashboard.utils.get_address_for_submission_client`).
ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
# Never uploaded: environments, version control, data and run outputs (they can be GBs).
# Ray's own default excludes (.git, .venv, venv, __pycache__) are among them.
DEFAULT_EXCLUDES = (
    ".venv", "venv", ".git", "**/__pycache__", "*.arrow", "runs", "bertforge-demo", "*.pt",
    "*.safetensors",
)
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}
TERMINAL = set(EXIT_CODES)


@dataclass
class SubmitConfig:
    entrypoint: list[str]
    address: str = DEFAULT_ADDRESS
    working_dir: str | None = "."
    excludes: tuple[str, ...] = DEFAULT_EXCLUDES
    image: str | None = None  # a container image that already holds bertforge
    submission_id: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    follow: bool = True

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ValueError("nothing to run: give the job's command after --, "
                             "e.g. bertforge submit -- bertforge train --data ...")
        if self.image and self.working_dir:
            raise ValueError("give either --image or --working-dir: an image carries the code")
        if self.working_dir and not os.path.isdir(self.working_dir):
            raise ValueError(f"working directory {self.working_dir} does not exist")

    def runtime_env(self, package_dir: str | None = None) -> dict[str, Any]:
        """`package_dir`: a built `bertforge/` directory (`shipped_package`) to ship as
        py_modules."""
        env: dict[str, Any] = {}
        if self.image:
            env["image_uri"] = self.image
        env_vars = dict(self.env_vars)
        if self.working_dir:
            env["working_dir"] = os.path.abspath(self.working_dir)
            env["excludes"] = list(self.excludes)
        if package_dir:
            env["py_modules"] = [os.path.abspath(package_dir)]
        if env_vars:
            env["env_vars"] = env_vars
        return env


def default_working_dir(entrypoint: list[str]) -> str | None:
    """The job's working directory when --working-dir is not given: this directory where it is
    a bertforge checkout (its code runs) or the job is no bertforge command (it may read the
    directory's files); else none. A bertforge command from another directory runs the
    cluster's bertforge on absolute paths, and uploading that directory was for nothing: with
    its data and runs (267 MiB) the cluster refused the job ("413 Maximum request body size")."""
    if package_folders(".") is not None or bertforge_arguments(entrypoint) is None:
        return "."
    return None


@contextlib.contextmanager
def shipped_package(working_dir: str | None) -> Iterator[str | None]:
    """The `bertforge/` built from the working dir when it is a bertforge checkout, else None;
    it lives until the job is submitted (the client uploads it during `submit_job`)."""
    if not working_dir or package_folders(working_dir) is None:
        yield None
        return
    with built_package(working_dir) as package:
        yield package


def describe_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """The runtime env as safe to print: variable names only, never their values."""
    shown = dict(runtime_env)
    if "env_vars" in shown:
        shown["env_vars"] = {name: "<hidden>" for name in shown["env_vars"]}
    return shown


def jobs_address(given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The Jobs API address a submission, a follow and a stop go to, resolved once: `given`
    (--address), else RAY_API_SERVER_ADDRESS, else RAY_ADDRESS (as Ray's client reads them),
    else the tunnel's http://127.0.0.1:8265. Ray's client let the variables win unseen: the job
    went to one, the command named 8265.

    The Jobs API is HTTP on the dashboard's port, so a bare HOST:PORT given, as `ray dashboard`
    prints it, is http://HOST:PORT (Ray's client took it for a GCS address: 40 s, then a
    traceback), and anything else given that is no http(s) address (`auto`, `ray://...`,
    which Ray's client turns into GCS or Ray Client look-ups) is refused in one line."""
    if given is None:
        # Only an http(s) value names the Jobs API: RAY_ADDRESS=HOST:6379, as on a head node,
        # is the cluster's GCS address, for `ray.init`; its dashboard is then the default's.
        values = (environ.get(name, "").strip().rstrip("/") for name in ADDRESS_VARIABLES)
        return next((value for value in values if _is_http_address(value)), DEFAULT_ADDRESS)
    address = given.strip().rstrip("/")
    if "://" not in address and address not in ("auto", "local"):
        address = f"http://{address}"
    if _is_http_address(address):
        return address
    raise UserInputError(
        f"--address {given} is no Ray dashboard address: give the dashboard's http address, "
        f"where the Jobs API answers (default {DEFAULT_ADDRESS}, where `ray dashboard` "
        "tunnels it)")


def _is_http_address(address: str) -> bool:
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port  # ValueError where it is no number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def jobs_client(address: str):
    """A Jobs API client that authenticates with the cluster's token when one is at hand.

    Ray clusters require a token by default, but the client sends it only when RAY_AUTH_MODE
    was `token` when ray was imported; passing the header ourselves works either way.
    """
    from ray.job_submission import JobSubmissionClient

    # Its INFO lines ("Uploading package ...", "Creating a file package ...", "WebSocket
    # closed ...") are no news to a user who just submitted; warnings still show.
    # (dashboard_sdk and the job sdk set INFO on their own loggers.)
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _drop_rays_default_excludes_notice()
    from ray.exceptions import AuthenticationError

    token = cluster_token()
    headers = {"authorization": f"Bearer {token}"} if token else None
    try:
        # Ray's client lets these override any address it is given; `address` is resolved
        # from them already (`jobs_address`), and what the command says must be where it went.
        with _variables_hidden(ADDRESS_VARIABLES):
            return JobSubmissionClient(address, headers=headers)
    except ConnectionError as error:  # Ray raises it with a 90-line chain behind it
        raise UserInputError(_no_dashboard_at(address, str(error).splitlines()[0])) from None
    except AuthenticationError:  # a traceback, then Ray's advice in 8 lines
        raise UserInputError(_token_refused(address, token)) from None


def _token_refused(address: str, token: str | None) -> str:
    """The cluster asks for its token (`ray start --head` turns that on where the head has one):
    none here, or another cluster's."""
    what = ("and this machine has none" if token is None else
            f"and refused this machine's ({_token_source()})")
    return (f"the Ray cluster at {address} asks for its token {what}: copy the head's "
            "~/.ray/auth_token to ~/.ray/ here, or set RAY_AUTH_TOKEN to its contents")


def _no_dashboard_at(address: str, reason: str) -> str:
    """Why the Jobs API did not answer, in one line. Something else listening there is most
    often the head's GCS port, which `ray start --head` prints first, for `ray start --address`:
    "no Ray cluster answers" sent the user to start a cluster that was running."""
    if not _something_listens_at(address):
        return (f"no Ray cluster answers at {address} ({reason}); start one (`ray start "
                "--head`, the launcher configs in infra/) or give its dashboard address with "
                "--address (default port 8265)")
    return (f"what answers at {address} is no Ray dashboard ({reason}); give the dashboard's "
            "address with --address (`ray start --head` prints it after 'view the dashboard "
            "at'; port 8265 by default), not the one `ray start --address` takes (the "
            "cluster's GCS, port 6379 by default)")


def _something_listens_at(address: str) -> bool:
    parts = urllib.parse.urlsplit(address)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=2.0):
            return True
    except OSError:
        return False


class _RaysDefaultExcludesNotice(logging.Filter):
    """Ray 2.60's warning, per submission, that it now leaves `.git`, `.venv`, `venv` and
    `__pycache__` out of a working directory ("Directory '.git' is now ignored by default
    ..."): our excludes leave them out anyway (DEFAULT_EXCLUDES), so it is no news, and every
    `bertforge submit` from a checkout opened with two such lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is now ignored by default when packaging" not in record.getMessage()


def _drop_rays_default_excludes_notice() -> None:
    logger = logging.getLogger("ray._private.runtime_env.working_dir")
    if not any(isinstance(f, _RaysDefaultExcludesNotice) for f in logger.filters):
        logger.addFilter(_RaysDefaultExcludesNotice())


@contextlib.contextmanager
def _variables_hidden(names: tuple[str, ...]) -> Iterator[None]:
    hidden = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def cluster_token() -> str | None:
    """RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (Ray's own
    lookup order)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = _token_source()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    return None


def _token_source() -> str:
    """Where `cluster_token` reads the token: RAY_AUTH_TOKEN, or the file's path."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    return os.environ.get("RAY_AUTH_TOKEN_PATH", os.path.expanduser("~/.ray/auth_token"))


def entrypoint_command(words: list[str]) -> str:
    """The job's command line: Ray runs it through a shell, so each word is quoted as the
    user's shell had it (`--data "/shared/my shards"` stays one argument, `*` and `;` stay
    literal). A single word is taken as a command line of its own, as `ray job submit` does."""
    return words[0] if len(words) == 1 else shlex.join(words)


def bertforge_arguments(words: list[str]) -> list[str] | None:
    """What a submitted command hands bertforge's command line (`bertforge train ...`,
    `python -m bertforge.cluster.cli train ...`, after any NAME=VALUE words), or None when it
    runs something else. Of a one-word command line (`"bertforge train ... && echo done"`)
    only the first simple command counts: the shell runs the rest."""
    if len(words) == 1:
        lexer = shlex.shlex(words[0], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(itertools.takewhile(lambda word: not _SHELL_OPERATOR.fullmatch(word),
                                         lexer))
    words = list(itertools.dropwhile(_ENV_ASSIGNMENT.fullmatch, words))
    if not words:
        return None
    program = os.path.basename(words[0])
    if program == "bertforge":
        return words[1:]
    if _PYTHON.fullmatch(program) and words[1:3] == ["-m", "bertforge.cluster.cli"]:
        return words[3:]
    return None


_SHELL_OPERATOR = re.compile(r"[();<>|&]+")
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
_PYTHON = re.compile(r"python[\d.]*")


def submit(config: SubmitConfig) -> int:
    """Submit, then (with follow) stream logs and return the exit code of the final status."""
    client = jobs_client(config.address)
    with shipped_package(config.working_dir) as package_dir:
        runtime_env = config.runtime_env(package_dir)
        job_id = _submit_when_ready(
            client,
            entrypoint=entrypoint_command(config.entrypoint),
            submission_id=config.submission_id,
            runtime_env=runtime_env,
        )
    if package_dir:
        folders = ", ".join(package_folders(config.working_dir))
        runtime_env["py_modules"] = [
            f"bertforge ({folders} of {os.path.abspath(config.working_dir)})"]
    elif config.working_dir:
        print(f"[submit] {os.path.abspath(config.working_dir)} is no bertforge checkout: the "
              "job runs the bertforge installed on the cluster", flush=True)
    elif not config.image:
        print(f"[submit] {os.path.abspath('.')} is no bertforge checkout: nothing uploaded; the "
              "job runs the bertforge installed on the cluster (--working-dir uploads a "
              "directory)", flush=True)
    print(f"[submit] job {job_id} submitted to {config.address} "
          f"(runtime env {describe_runtime_env(runtime_env)})", flush=True)
    if not config.follow:
        print(f"[submit] {_how_to_reach(config.address, job_id)}", flush=True)
        return 0
    return follow(client, config.address, job_id)


def follow(client, address: str, job_id: str) -> int:
    """Stream a job's logs (from its start) to its end and return the exit code of its final
    status. A stop of this command (Ctrl-C, SIGTERM) stops following, not the job: a training
    job outlives the terminal that submitted it; the stop's line says how to reach it."""
    from bertforge.cluster.launch.local_ray import StoppedBySignal

    try:
        asyncio.run(_follow_logs(client, job_id))
        return final_status(client, job_id, hint=(
            f"its logs ended; {_how_to_reach(address, job_id)}"))
    except StoppedBySignal as stop:
        # The log tail's HTTP session, cut short, would be reported as "Task was destroyed but
        # it is pending!" when the loop goes: expected here, and no news to the user.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        status = _status_within(client, job_id, seconds=5.0)
        stop.note = (f"job {job_id} {status}" if status in TERMINAL else
                     f"job {job_id} keeps running; {_how_to_reach(address, job_id)}")
        raise


def _status_within(client, job_id: str, seconds: float) -> str | None:
    """The job's status, or None where the cluster does not answer within `seconds` (Ray's
    client has no timeout of its own; a stop must not hang on a stalled tunnel)."""
    result: list[str] = []

    def ask() -> None:
        with contextlib.suppress(Exception):
            result.append(str(client.get_job_status(job_id).value))

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(seconds)
    return result[0] if result else None


def follow_job(address: str, job_id: str) -> int:
    """`bertforge submit --follow ID`: a job submitted earlier, followed to its end."""
    client = jobs_client(address)
    try:
        status = client.get_job_status(job_id)
    except RuntimeError as error:  # no such job, most often
        raise UserInputError(f"cannot follow job {job_id}: {_ray_reason(error)}") from None
    print(f"[submit] following job {job_id} ({status.value})", flush=True)
    return follow(client, address, job_id)


def _how_to_reach(address: str, job_id: str) -> str:
    command = f"bertforge submit --address {address}"
    return f"`{command} --follow {job_id}` follows it, `{command} --stop {job_id}` stops it"


def _submit_when_ready(client, timeout_s: float = 120.0, **job) -> str:
    """A cluster that has just started answers before its job agent is up; wait for it."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as error:
            if "No available agent" not in str(error) or time.time() > deadline:
                # A submission id used before, a runtime env the cluster cannot build: Ray's
                # own words, as one line.
                reason = _ray_reason(error)
                if "already exists" in reason:
                    reason += (" (an id names one job for good; a resubmitted command needs a "
                               "new --submission-id or none, and --resume auto still finds its "
                               "run)")
                raise UserInputError(f"the cluster refused the job: {reason}") from None
            time.sleep(2.0)


def stop(address: str, job_id: str, timeout_s: float = 60.0) -> int:
    """Ask the job to stop and wait for its final status."""
    client = jobs_client(address)
    try:
        stopping = client.stop_job(job_id)  # False: it had ended
    except RuntimeError as error:  # no such job, most often
        raise UserInputError(f"cannot stop job {job_id}: {_ray_reason(error)}") from None
    if not stopping:  # its status alone read as if this stop had ended it
        print(f"[submit] job {job_id} had already ended: nothing to stop", flush=True)
    code = final_status(client, job_id, timeout_s=timeout_s, hint=(
        "it was asked to stop and the cluster may still end it; the same command asks again"))
    if stopping:
        _show_its_last_word(client, job_id)
    return code


def _show_its_last_word(client, job_id: str) -> None:
    """A stopped bertforge command's own last line ("bertforge train: stopped by SIGTERM;
    newest committed checkpoint ...; the same command resumes from it"): what a resubmission
    continues from. `--stop` said only STOPPED, and the line was in the job's logs alone."""
    with contextlib.suppress(Exception):  # the logs are a courtesy: the stop has happened
        lines = [line for line in client.get_job_logs(job_id).splitlines() if line.strip()]
        own = [line for line in lines if line.startswith("bertforge ")]
        if own and own[-1] == lines[-1]:
            print(f"[submit] job {job_id} ended with: {own[-1]}", flush=True)


def _ray_reason(error: Exception) -> str:
    """What Ray's Jobs client error says happened, in one line. The client puts the agent's
    whole HTTP reply in it: where that is a traceback, its last exception line ("ValueError:
    Job with submission_id x already exists. ..."), else the reply's first line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
    if raised:
        return raised[-1].split(": ", 1)[1]
    return lines[0] if lines else type(error).__name__


def final_status(client, job_id: str, timeout_s: float = 600.0, *, hint: str = "") -> int:
    """Wait for a terminal status (logs may end a moment before it is recorded); `hint`: what
    the user can do when it does not come."""
    deadline = time.time() + timeout_s
    status = str(client.get_job_status(job_id).value)
    while status not in TERMINAL and time.time() < deadline:
        time.sleep(0.5)
        status = str(client.get_job_status(job_id).value)
    print(f"[submit] job {job_id} {status}", flush=True)
    if status not in TERMINAL:
        raise UserInputError(f"job {job_id} still {status} after {timeout_s:.0f} s ({hint})")
    return EXIT_CODES[status]


async def _follow_logs(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        sys.stdout.write(lines)
        sys.stdout.flush()
