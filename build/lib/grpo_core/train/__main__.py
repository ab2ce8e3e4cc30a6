"""`python -m grpo_core.train`: run one stage from its config file (see `entry.main`)."""
from grpo_core.policy import dist
from grpo_core.train.entry import main

main()
dist.end_worker_process()  # skips a teardown race in gloo that can abort a finished worker
