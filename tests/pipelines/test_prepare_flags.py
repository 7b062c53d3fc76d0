"""`bertforge prepare` flags: dashed like every other command, Beam's underscores accepted."""

import dataclasses

import pytest

from bertforge.pipelines.prepare_options import (
    PrepareConfig,
    check_beam_args,
    help_text,
    parse_command_line,
)

REQUIRED = ["--input=a.jsonl", "--output=o", "--vocab=v"]


@pytest.mark.parametrize("flags", [
    ["--max-seq-length=64", "--num-shards", "3", "--lower-case=false",
     "--random-pool-chars=1000"],
    ["--max_seq_length=64", "--num_shards", "3", "--lower_case=false",
     "--random_pool_chars=1000"],
])
def test_both_spellings_reach_the_config(flags):
    command = parse_command_line(REQUIRED + flags + ["--runner=DirectRunner"])
    config = command.config
    assert (config.max_seq_length, config.num_shards, config.lower_case,
            config.random_pool_chars) == (64, 3, False, 1000)
    assert command.beam_args == ("--runner=DirectRunner",)


def test_help_shows_the_dashed_flag_first_for_every_option():
    text = help_text()
    for f in dataclasses.fields(PrepareConfig):
        if f.name == "inputs":
            assert "--input INPUTS" in text
            continue
        dashed, beam = "--" + f.name.replace("_", "-"), "--" + f.name
        assert dashed in text, dashed
        if beam != dashed:
            assert text.index(dashed) < text.index(beam), f.name


def test_beam_flags_stay_as_beam_spells_them_and_may_not_set_job_options():
    command = parse_command_line(REQUIRED + ["--direct_num_workers=2"])
    assert command.beam_args == ("--direct_num_workers=2",)
    with pytest.raises(ValueError, match="unknown flag.*--direct-num-workers"):
        parse_command_line(REQUIRED + ["--direct-num-workers=2"])
    for spelling in ("--num-shards=2", "--num_shards=2"):
        with pytest.raises(ValueError, match="must not set the job's own options"):
            check_beam_args([spelling])
    # Beam's own parser would print its help and exit 0: in a pipeline file's beam_args, say.
    with pytest.raises(ValueError, match="unknown flag.*--help"):
        check_beam_args(["--runner=DirectRunner", "--help"])


@pytest.mark.parametrize(("beam_args", "mode"), [
    (["--direct_num_workers=2"], "multi_processing"),
    (["--direct_num_workers", "4"], "multi_processing"),
    (["--direct_num_workers=2", "--direct_running_mode=multi_threading"], "multi_threading"),
    (["--direct_num_workers=2", "--direct_running_mode", "in_memory"], "in_memory"),
    (["--direct_num_workers=1"], "in_memory"),
    ([], "in_memory"),
])
def test_worker_processes_asked_for_are_what_a_local_run_gets(beam_args, mode):
    """`--direct_num_workers 2` alone ran one process (Beam's in_memory mode), saying so in
    the log only; a mode given explicitly is kept."""
    from apache_beam.options.pipeline_options import DirectOptions

    options = parse_command_line(REQUIRED + beam_args).options
    assert options.view_as(DirectOptions).direct_running_mode == mode


def test_a_bad_value_or_a_missing_one_is_one_error_naming_the_flag():
    with pytest.raises(ValueError, match="--num-shards.*invalid int value: 'abc'"):
        parse_command_line(REQUIRED + ["--num-shards=abc"])
    # Beam's flags too (Beam's parser printed its 129-line usage and exited).
    with pytest.raises(ValueError, match="--direct_num_workers: invalid int value: 'two'"):
        parse_command_line(REQUIRED + ["--direct_num_workers", "two"])
    with pytest.raises(ValueError, match="--direct_running_mode: invalid choice: 'bogus'"):
        check_beam_args(["--direct_running_mode=bogus"])
    with pytest.raises(ValueError, match="inputs are required"):
        parse_command_line(["--output=o", "--vocab=v"])
    with pytest.raises(ValueError, match="unexpected argument.*stray"):
        parse_command_line(REQUIRED + ["stray"])
    # A boolean as every other command spells it too (vocab's --no-lower-case), beside Beam's.
    for spelling in (["--no-lower-case"], ["--no_lower_case"], ["--lower-case=false"]):
        assert parse_command_line(REQUIRED + spelling).config.lower_case is False
    assert parse_command_line(REQUIRED).config.lower_case is True
    with pytest.raises(ValueError, match="must not set the job's own options"):
        check_beam_args(["--no-lower-case"])
    # A flag that would change nothing is refused, not ignored.
    with pytest.raises(ValueError, match="num_validation_shards 3 with validation_fraction 0"):
        parse_command_line(REQUIRED + ["--num-validation-shards=3", "--validation-fraction=0"])


def test_several_inputs_after_one_flag_are_all_read_as_vocab_reads_them():
    """`prepare --input 'wiki/*.bz2' 'books:b/*.txt'` (vocab's form, or an unquoted glob the
    shell expanded) was refused: the second pattern was "an unexpected argument"."""
    command = parse_command_line(["--input", "w/*.xml.bz2", "books:b/*.txt", "--input=c.jsonl",
                                  "--output=o", "--vocab=v", "--runner", "DirectRunner"])
    assert command.config.inputs == ("w/*.xml.bz2", "books:b/*.txt", "c.jsonl")
    assert command.beam_args == ("--runner", "DirectRunner")


def test_no_wait_and_beams_own_options_are_read_from_the_one_parse():
    command = parse_command_line(REQUIRED + ["--no-wait", "--runner=DataflowRunner", "--quiet",
                                             "--dry_run=True"])
    assert not command.wait and command.quiet and command.dry_run
    assert "--no-wait" not in command.beam_args
    plain = parse_command_line(REQUIRED)
    assert plain.wait and not plain.quiet and not plain.dry_run
    # Beam keeps --dry_run's text: "False" was true, a dry run that a script took for a run.
    assert not parse_command_line(REQUIRED + ["--dry_run=False"]).dry_run
    assert parse_command_line(REQUIRED + ["--dry_run", "true"]).dry_run
    # --no-wait of a local run: it ran and waited all the same, without a word.
    with pytest.raises(ValueError, match="^--no-wait is for a job that runs elsewhere "
                       r"\(DataflowRunner\); DirectRunner runs it in this process"):
        parse_command_line(REQUIRED + ["--no-wait"])
    with pytest.raises(ValueError, match="^--dry_run=maybe: give True or False$"):
        parse_command_line(REQUIRED + ["--dry_run=maybe"])


def test_a_dataflow_job_that_would_fail_or_lose_its_output_is_named_before_it_is_sent():
    """Local inputs (the workers cannot read them), a local output (each worker's own disk,
    gone with it) and Beam's stock image (no bertforge) were sent to Dataflow unsaid."""
    from bertforge.pipelines.prepare_options import dataflow_problems

    dataflow = ["--runner=DataflowRunner", "--project=p", "--region=r",
                "--temp_location=gs://b/tmp"]
    command = parse_command_line(["--input=books:corpus/*.txt", "--input=gs://b/wiki.xml.bz2",
                                  "--output=shards", "--vocab=vocab.txt", *dataflow])
    problems = dataflow_problems(command.config, command.options)
    assert [problem.split(" is ")[0] for problem in problems[:2]] == [
        "--input books:corpus/*.txt", "--output shards"]
    assert problems[2].startswith("the workers would run Beam's stock image, which has no "
                                  "bertforge: give --sdk_container_image")
    ready = parse_command_line(["--input=gs://b/wiki.xml.bz2", "--output=gs://b/shards",
                                "--vocab=vocab.txt", *dataflow, "--sdk_container_image=i"])
    assert dataflow_problems(ready.config, ready.options) == []  # the vocabulary may be local


def test_beams_worker_start_notice_is_kept_off_the_console(caplog):
    """The local job service relays each worker's 'No semi_persistent_directory found' WARN."""
    import logging

    import bertforge.pipelines.prepare  # noqa: F401  (installs the filter)

    relay = logging.getLogger("apache_beam.runners.portability.local_job_service")
    with caplog.at_level(logging.WARNING):
        relay.warning('Worker: severity: WARN message: "No semi_persistent_directory found:  '
                      'User registered objects ... may not be effective"')
        relay.warning("Worker: severity: ERROR message: a real worker error")
    assert [r.getMessage() for r in caplog.records] == [
        "Worker: severity: ERROR message: a real worker error"]


@pytest.mark.parametrize("lower_case", [True, False])
def test_a_vocabulary_of_the_other_casing_is_warned_about(lower_case, caplog):
    """Google's uncased vocab with --no-lower-case went unsaid (one capital of another
    script, "ℝ", passed for cased): 9.5 % of a Wikipedia excerpt's tokens became [UNK]."""
    from bertforge.pipelines.contract.tokenization import parse_vocab
    from bertforge.pipelines.prepare import _warn_on_casing_mismatch
    from tests.pipelines.conftest import shared_data_file

    uncased = parse_vocab(shared_data_file("bert-base-uncased-vocab.txt").read_bytes())
    cased = {**{token: i for i, token in enumerate(["[PAD]", "[UNK]", "the", "##s"])},
             **{word: 4 + i for i, word in enumerate(["Paris", "London", "##X", "Rome"])}}
    with caplog.at_level("WARNING", logger="bertforge.pipelines.prepare"):
        _warn_on_casing_mismatch(uncased, lower_case)
        _warn_on_casing_mismatch(cased, lower_case)
    warned = [record.getMessage() for record in caplog.records]
    # Each names the setting as prepare's flag and as a pipeline file's key says it.
    if lower_case:
        assert len(warned) == 1 and "a cased vocab?" in warned[0]
        assert "--no-lower-case ([vocab] lower_case = false)" in warned[0]
    else:
        assert len(warned) == 1 and "an uncased vocab?" in warned[0]
        assert "(without --no-lower-case; [vocab] lower_case = true)" in warned[0]
