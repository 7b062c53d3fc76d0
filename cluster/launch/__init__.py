"""Where and how a run goes: Ray Train workers (`ray_train`) on a private local Ray
(`local_ray`) or a cluster (`submit`: a Ray job), one local worker process without Ray
(`local_worker`), checkpoints in Ray storage (`persistence`), which failures are retried
(`failure_policy`), and what the console shows of the driver and the workers (`worker_output`)."""
