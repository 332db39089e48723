"""Tensor parallelism: the group and its collectives (group.py), splitting a model and its LoRA
adapters across ranks (shard.py), the driver's step plans sent to the other ranks
(plan_broadcast.py), and the follower ranks' processes (workers.py). The first three sit below
the model side, which uses them; workers.py sits above it (it builds a rank's model runner)."""
