"""One worker process: its place in the job, its process group, one training attempt, and how it ends.

- ``main``       the worker's command line: arguments and config, then the process (the zygote starts here too).
- ``process``    the process: logging, signals, the process group up and down, the exit status.
- ``attempt``    one training attempt, from a process group that is up to the end of training.
- ``ending``     how an attempt ends: its ``end`` event, what is kept, the exit status (one place).
- ``run_dir``    rank 0 claims the generation in the run directory; every rank learns the outcome.
- ``group``      the process group brought up (the job's store, a deadline) and rebuilt in the process.
- ``standby``    a standby worker, ready before one fails.
- ``watchdog``   peer liveness: a dead or hung peer ends the attempt everywhere within seconds.
- ``preflight``  start-up warnings for launch settings known to fail.

What a process does when the job breaks, and what it tells the agents then, is the recovery protocol's
(``elastic_runner.recovery``, the floor below). The process group itself (``elastic_runner.dist``), the environment (``elastic_runner.env``) and the process's
primitives (``elastic_runner.lifecycle``: exit statuses, stop signals, leaving at once) are on the ground floor,
for every room.
"""
