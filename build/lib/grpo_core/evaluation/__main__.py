"""`python -m grpo_core.evaluation`: the greedy evaluation CLI (see `greedy.main`)."""
from grpo_core.evaluation.greedy import main

main()
