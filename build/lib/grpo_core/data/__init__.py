"""What a stage trains and is evaluated on: the tasks (one file each, with their params and
splits), the seeded prompt stream, the difficulty-aware prompt pool, answer reading and the
reward functions.

May import io and algo; never config (a task declares its own params) or anything above."""
