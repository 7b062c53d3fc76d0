"""The local runner of the Beam jobs: Beam's FnApiRunner with its data on disk, bounded memory,
progress lines and resume after a kill (`runner.LocalRunner`)."""
