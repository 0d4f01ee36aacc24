"""Imported by the zygote after :mod:`elastic_runner.agent.warm` when the snapshots live in a bucket.

``s3fs`` with aiobotocore, botocore and aiohttp (0.17 s of imports here, which every restarted worker would pay
again on its recovery's path). Imports only: no client, no event loop, no thread (fsspec starts its loop thread on
first use, in the worker), see :mod:`elastic_runner.agent.warm`.
"""

import contextlib

with contextlib.suppress(ImportError):  # without the s3 extra the worker says which package is missing
    import s3fs  # noqa: F401
