"""Ray Train launch, orchestration and the bertforge command line."""
