"""The agent side of ``elastic-runner launch``: zygote workers, our elastic agent,
faster rendezvous completion, and agent-level metrics.

Everything here runs in the torchrun agent process (or the zygote it forks
workers from), never in the training loop.
"""
