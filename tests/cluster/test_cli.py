import contextlib
import os
import subprocess
import sys

import pytest

from bertforge.cluster.cli import build_parser, main

WORKING_COMMANDS = {"vocab", "prepare", "inspect", "train", "submit", "eval", "export", "demo",
                    "pipeline", "finetune"}


def test_help_lists_exactly_the_working_commands():
    help_text = build_parser().format_help()
    listed = {name for name in WORKING_COMMANDS if f"    {name} " in help_text}
    assert listed == WORKING_COMMANDS


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "bertforge.cluster.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "demo" in out and "train" in out


# What the command line may not import to read its flags: each costs seconds of a core
# (`ray.train.torch` 4.8 s on 2 AVX2 cores), paid by every command before its first line.
ENGINES = ("ray", "torch", "deepspeed", "apache_beam", "transformers")


def test_reading_the_flags_imports_no_engine():
    probe = ("import sys; from bertforge.cluster.cli import build_parser; build_parser(); "
             f"print(sorted(m for m in {ENGINES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_unknown_flag_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "somewhere", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_mistyped_flag_shows_the_command_s_usage_and_the_nearest_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", "d", "--run-dir", "r", "--max-setps", "10"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: bertforge train ")  # not the top level's `bertforge COMMAND`
    assert "--max-setps: did you mean --max-steps?" in err
    # A short usage (what train requires; --help for the rest), not its 38 lines of flags.
    assert err.splitlines()[0] == ("usage: bertforge train [options] --data DATA --run-dir "
                                   "RUN_DIR  (`bertforge train --help`)")
    assert len(err.splitlines()) == 3 and "--preset" not in err
    with pytest.raises(SystemExit):  # --help still lists every flag
        main(["train", "--help"])
    assert "[--preset {tiny,mini,base,large}]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["inspect", "somewhere", "--bogus"])
    assert "did you mean" not in capsys.readouterr().err  # nothing near: no guess


def test_missing_dataset_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "manifest.json" in err and "Traceback" not in err


def test_export_of_a_run_without_checkpoints_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert "neither a complete checkpoint nor a run with one" in capsys.readouterr().err


def train_config(*flags):
    from bertforge.cluster.cli import train_config_from_args

    args = build_parser().parse_args(["train", "--data", "d", "--run-dir", "r", *flags])
    return train_config_from_args(args)


def test_train_without_recipe_uses_defaults_and_flags():
    cfg = train_config("--steps", "200", "--lr", "3e-4", "--zero-stage", "1")
    assert (cfg.max_steps, cfg.learning_rate, cfg.zero_stage) == (200, 3e-4, 1)
    assert cfg.warmup_steps == 20 and cfg.model == {"preset": "tiny"} and cfg.resume


def test_recipe_values_hold_unless_a_flag_overrides_them():
    cfg = train_config("--recipe", "bert_large_phase1", "--steps", "10", "--warmup-steps", "1",
                       "--resume", "never")
    assert cfg.model == {"preset": "large"} and cfg.global_batch_size == 4096
    assert cfg.max_steps == 10 and not cfg.resume
    phase2 = train_config("--recipe", "bert_base_phase2", "--init-from", "runs/phase1")
    assert phase2.init_from == "runs/phase1"


def test_phase2_recipe_without_init_from_is_a_clear_error(capsys):
    assert main(["train", "--data", "d", "--run-dir", "r", "--recipe", "bert_large_phase2"]) == 2
    assert "give --init-from" in capsys.readouterr().err


def _unused_port() -> int:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_submit_with_no_cluster_is_one_line(capsys):
    port = _unused_port()
    # --help is the job's to print: not answered here.
    assert main(["submit", "--address", f"http://127.0.0.1:{port}", "--", "bertforge", "train",
                 "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"bertforge submit: error: no Ray cluster answers at http://127.0.0.1:{port}"), err
    # HOST:PORT, as `ray dashboard` prints it, is http (Ray's client took it for a GCS address:
    # 40 s, then a 29-line traceback); what is no http address at all is refused at once.
    for address, line in (
            (f"127.0.0.1:{port}", f"no Ray cluster answers at http://127.0.0.1:{port} ("),
            ("auto", "--address auto is no Ray dashboard address: give the dashboard's http "
                     "address, where the Jobs API answers (default http://127.0.0.1:8265"),
            ("ray://127.0.0.1:10001", "--address ray://127.0.0.1:10001 is no Ray dashboard "
                                      "address")):
        assert main(["submit", "--address", address, "--", "bertforge", "train", "--help"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"bertforge submit: error: {line}"), err


def test_submit_to_a_port_where_no_dashboard_answers_names_the_dashboards(capsys):
    """`ray start --head` prints the GCS address first (`ray start --address='HOST:6379'`);
    given to `bertforge submit --address`, it was "no Ray cluster answers at ...; start one",
    of a cluster that was running. Something that listens there and is no dashboard: a
    server that hangs up, as the GCS's gRPC port does on an HTTP request."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = server.accept()
                connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        assert main(["submit", "--address", f"127.0.0.1:{port}", "--follow", "job-1"]) == 2
    finally:
        server.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"bertforge submit: error: what answers at http://127.0.0.1:{port} is no Ray dashboard "
        "("), err
    assert err[0].endswith("give the dashboard's address with --address (`ray start --head` "
                           "prints it after 'view the dashboard at'; port 8265 by default), "
                           "not the one `ray start --address` takes (the cluster's GCS, port "
                           "6379 by default)"), err


def test_submit_without_the_clusters_token_is_one_line(tmp_path, monkeypatch, capsys):
    """A cluster started by hand (`ray start --head` with a token) asks every client for it:
    without it, or with another cluster's, `bertforge submit` ended in Ray's traceback. Its
    dashboard's answers, as Ray 2.60's gives them: 401 without a token, 403 for a wrong one."""
    import http.server
    import threading

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name for GET
            refused = self.headers.get("authorization") is not None
            self.send_response(403 if refused else 401)
            self.end_headers()
            self.wfile.write(b"Forbidden: Invalid authentication token" if refused else
                             b"Unauthorized: Missing authentication token")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))  # none there
    try:
        for token, what in ((None, "and this machine has none"),
                            ("another-clusters", f"and refused this machine's ({tmp_path}"
                                                 "/auth_token)")):
            if token:
                (tmp_path / "auth_token").write_text(token)
            assert main(["submit", "--address", url, "--follow", "job-1"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"bertforge submit: error: the Ray cluster at {url} asks for its "
                           f"token {what}: copy the head's ~/.ray/auth_token to ~/.ray/ here, "
                           "or set RAY_AUTH_TOKEN to its contents"], err
    finally:
        server.shutdown()


def test_a_submitted_commands_mistakes_are_refused_before_it_is_submitted(capsys):
    """A mistyped flag or a bad value in `bertforge submit -- bertforge train ...` used to be
    found once the job ran on the cluster (its upload and start first); it is refused here, as
    the job would refuse it, and nothing reaches the cluster."""
    address = f"http://127.0.0.1:{_unused_port()}"
    nothing_submitted = ("; nothing was submitted (it was checked against this bertforge: "
                         "--no-command-check submits it as it is)")
    train = ["train", "--address", "auto", "--data", "/shared/shards", "--run-dir",
             "/shared/runs/r"]
    refused = [
        (["bertforge", *train, "--max-setps", "10"],
         "the job's command is refused above"),
        # A command line of one word: its first command is checked, the shell runs the rest.
        ([" ".join(["bertforge", *train, "--workers", "0", "&&", "echo", "done"])],
         "the job's command: workers must be at least 1, got 0"),
        (["RAY_DEDUP_LOGS=0", "bertforge", *train, "--recipe", "bert_large_phase2"],
         "the job's command: recipe bert_large_phase2 warm-starts from phase 1: give "
         "--init-from"),
        (["python3", "-m", "bertforge.cluster.cli", "glue", "--address", "auto", "--model",
          "/m", "--tasks", "nope"],
         "the job's command: --tasks: 'nope' is no GLUE task"),
        # Without --address the job started a second Ray on the driver's node and trained
        # there alone, beside the cluster.
        (["bertforge", "train", "--data", "/shared/shards", "--run-dir", "/shared/runs/r"],
         "the job's command: no --address: the job would start a Ray of its own on the node "
         "its driver runs on and run there alone, not on the cluster's nodes; add --address "
         "auto"),
        (["bertforge", "finetune", "--task", "rte", "--model", "/m", "--output", "/o"],
         "the job's command: no --address"),
        # A relative output lands in the job's temporary working directory: refused there,
        # after the upload and the job's start; here, before.
        (["bertforge", "train", "--address", "auto", "--data", "/shared/shards", "--run-dir",
          "runs/r"],
         "the job's command: --run-dir runs/r is relative: give an absolute path every node "
         "mounts (a job's working directory is a temporary copy)"),
        (["bertforge", "prepare", "--input", "corpus", "--output", "shards", "--vocab", "v.txt"],
         "the job's command: --output shards is relative: give an absolute path every node "
         "mounts"),
        # prepare's rest: the job's flags and Beam's, as prepare itself parses them.
        (["bertforge", "prepare", "--input", "gs://b/c/*.jsonl", "--output", "gs://b/s",
          "--vocab", "gs://b/v.txt", "--num-shards", "abc"],
         "the job's command: argument --num-shards/--num_shards: invalid int value: 'abc'"),
    ]
    for command, message in refused:
        assert main(["submit", "--address", address, "--", *command]) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"bertforge submit: error: {message}"), err
        assert last.endswith(nothing_submitted), err
        if "--max-setps" in command:  # argparse's own lines above it, with the nearest flag
            assert "  --max-setps: did you mean --max-steps?" in err
    # What passes the check, another program, and --no-command-check go on to the cluster.
    for argv in (["--", "bertforge", *train, "--recipe", "bert_large_phase1"],
                 ["--", "bertforge", "prepare", "--input", "gs://b/c/*.jsonl", "--output",
                  "gs://b/s", "--vocab", "gs://b/v.txt", "--runner", "DataflowRunner",
                  "--project", "p", "--region", "europe-west4"],
                 ["--", "/opt/venv/bin/bertforge", *train, "--max-steps", "10"],
                 ["--", "python", "-c", "print(1)", "--max-setps"],
                 ["--no-command-check", "--", "bertforge", *train, "--max-setps", "10"]):
        assert main(["submit", "--address", address, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bertforge submit: error: no Ray cluster answers at {address}"), \
            (argv, err)


def test_a_relative_input_is_refused_where_nothing_is_uploaded(tmp_path, monkeypatch, capsys):
    """From a folder that is no bertforge checkout nothing is uploaded, and the job runs where
    the cluster's Ray started: `--data ../shards` was found missing there, once the job ran."""
    address = f"http://127.0.0.1:{_unused_port()}"
    monkeypatch.chdir(tmp_path)
    train = ["bertforge", "train", "--address", "auto", "--run-dir", "/shared/runs/r"]
    for command, what in (([*train, "--data", "../shards"], "--data ../shards"),
                          (["bertforge", "export", "runs/r", "--output", "/shared/hf"],
                           "CHECKPOINT runs/r")):
        assert main(["submit", "--address", address, "--", *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bertforge submit: error: the job's command: {what} is relative, "
                              "and nothing is uploaded for it to be relative to"), err
    # prepare's paths (its flags are its job's, parsed apart), vocab's --input (a list) and
    # inspect's DATA_DIR were not looked at: the job wrote its dataset where `ray start` ran.
    prepare = ["bertforge", "prepare", "--input", "/shared/corpus", "--output", "/shared/s",
               "--vocab", "/shared/v.txt"]
    refused = [
        (["bertforge", "prepare", "--input", "/shared/corpus", "--output", "prel", "--vocab",
          "/shared/v.txt"], "--output prel is relative: give an absolute path every node "
                            "mounts (nothing is uploaded, so it would be wherever the cluster's "
                            "Ray started)"),
        ([*prepare, "--input", "books:/shared/a.txt,corpus/b.txt"],
         "--input corpus/b.txt is relative, and nothing is uploaded"),
        ([*prepare, "--vocab", "v.txt"], "--vocab v.txt is relative, and nothing is uploaded"),
        (["bertforge", "vocab", "--input", "wiki:dumps", "--output", "/shared/v"],
         "--input dumps is relative, and nothing is uploaded"),
        (["bertforge", "inspect", "shards"], "DATA_DIR shards is relative, and nothing is "
                                             "uploaded"),
    ]
    for command, message in refused:
        assert main(["submit", "--address", address, "--", *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bertforge submit: error: the job's command: {message}"), err
    # Object storage is no relative path, and Beam's own flags are Beam's.
    for command in ([*prepare, "--input", "wiki:gs://b/dumps", "--output", "s3://b/s",
                     "--temp_location", "tmp"],
                    ["bertforge", "inspect", "gs://b/shards"]):
        assert main(["submit", "--address", address, "--", *command]) == 2
        assert f"no Ray cluster answers at {address}" in capsys.readouterr().err
    # Uploaded (--working-dir), the path is the upload's: it goes on to the cluster.
    (tmp_path / "job").mkdir()
    assert main(["submit", "--address", address, "--working-dir", "job", "--",
                 *train, "--data", "shards"]) == 2
    assert f"no Ray cluster answers at {address}" in capsys.readouterr().err


def test_a_home_the_shell_left_unexpanded_is_the_home_directory(tmp_path, monkeypatch, caplog):
    """`--output=~/x` (the shell expands a `~` only at a word's start) made a folder named
    `~` in the working directory; so did `--input books:~/a,~/b` for the inputs."""
    home, elsewhere = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    for name in ("a.txt", "b.txt"):
        (home / name).write_text("The cat sat on the mat.\n\nA dog ran in the park.\n" * 20)
    assert main(["vocab", "--input", "books:~/a.txt,~/b.txt", "--output=~/vocab",
                 "--vocab-size", "120"]) == 0
    assert (home / "vocab" / "vocab.txt").is_file()
    assert os.listdir(elsewhere) == []
    assert "tokens from 2 files" in caplog.text  # both inputs read


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`bertforge inspect DIR | head`: a BrokenPipeError traceback once head had its lines."""
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [1500, 1500]}, max_seq_length=64)
    reader = subprocess.Popen([sys.executable, "-m", "bertforge.cluster.cli", "inspect", data,
                               "--samples", "3000"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert reader.stdout.readline().startswith("dataset ")
    reader.stdout.close()  # as head does, with ~400 kB still to come
    err = reader.stderr.read()
    assert reader.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err
