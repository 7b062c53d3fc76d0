"""Pipeline-file keys keep the config fields' underscores; a flag's dashed spelling there is
pointed to the key's name."""

import pytest


def test_a_pipeline_file_written_with_flag_spellings_is_pointed_to_the_keys():
    from bertforge.cluster.commands.pipeline import PhaseSection
    from bertforge.cluster.launch.launch_config import LaunchConfig
    from bertforge.pipelines.contract.config_fields import from_table

    with pytest.raises(ValueError, match=r"\[cluster\]: cpus-per-worker \(keys are spelled "
                                         r"with underscores: cpus-per-worker -> cpus_per_worker"):
        from_table(LaunchConfig, "cluster", {"cpus-per-worker": 2})
    with pytest.raises(ValueError, match="max-steps -> max_steps"):
        PhaseSection("phase1", "bert_tiny_phase1", 64, {"max-steps": 3})
    with pytest.raises(ValueError, match="unknown key.*bogus; known") as error:
        from_table(LaunchConfig, "cluster", {"bogus": 2})
    assert "underscores" not in str(error.value)
