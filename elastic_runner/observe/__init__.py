"""Observing a run: events, metrics, goodput, the audit of consumed samples, the failure story, the report.

- ``events``         the run's event log (one JSON-lines file per worker attempt and per agent).
- ``metrics``        a worker's Prometheus instruments.
- ``goodput``        the share of wall time spent on steps that count, live and after the fact.
- ``audit``          per-step records of the samples each rank consumed, and the exactly-once checker.
- ``failure_story``  the one line rank 0 prints once the job steps again after a failure.
- ``report``         ``elastic-runner report``: a summary and a picture of a run.
- ``logs``           logging set-up and progress output, one write per line.
"""
