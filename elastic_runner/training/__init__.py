"""Training: the parts a step changes, the step, the loop, and the Checkpointer that saves and restores them.

- ``parts``          :class:`~.parts.TrainingParts`: model, optimizer, schedule, scaler, sampler, state, RNG.
- ``state``          :class:`~.state.TrainState`: step, samples, world history, the goodput clock.
- ``step``           one step's arithmetic: forward, loss, backward, gradient sync, update.
- ``gradients``      the exact global mean of the gradients, clipping, non-finite handling.
- ``parallel``       how the model is replicated and its gradients synchronised (DDP).
- ``loop``           the loop and what runs between steps (progress, evaluation, snapshots, stop).
- ``bookkeeping``    what is recorded about a step: audit, metrics, goodput clock, progress lines.
- ``evaluation``     the test set, sharded over ranks.
- ``checkpointer``   the Checkpointer: durable and node-memory tiers, restore.
- ``boundary``       the step lock, buffers as of the last step boundary, the node-memory keeper.
- ``compatibility``  whether a snapshot fits this configuration.
- ``adapt``          what a restored state adapts to this attempt (run length, schedule, learning rate).
- ``rng``            randomness that resumes exactly.
"""
