"""Data: which samples each step takes, and how they become batches on the device.

- ``sampler``   :class:`~.sampler.ElasticSampler`: every sample of an epoch exactly once, any world size.
- ``layout``    how one step's global batch splits over ranks and micro-batches.
- ``sources``   from index lists to batches on the device (tensors, or a DataLoader with workers).
- ``datasets``  datasets from config: the shipped digits, synthetic data, tokens, images, import paths.
- ``tokens``    memory-mapped token files for language models.
- ``images``    image datasets without downloads, and augmentation that resumes bitwise.
"""
