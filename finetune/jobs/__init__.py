"""Training runs in the background, as the app's Train tab needs them: describe a run, launch it
with the same command a user would type, watch it, stop it, resume it, push it.

One module per job:

    paths.py     where runs and uploads live, the run folder's files, which local paths a run may use
    spec.py      JobSpec: a run = the CLI's own TrainConfig + how to launch it; the app's preset
    command.py   the ``accelerate launch ... -m finetune ...`` argument list generated from a JobSpec
    uploads.py   checking an uploaded data file (in upload_check.py's confined child), the split, cleaning
    process.py   a run's processes (launcher and every rank, whatever their group): liveness from one
                 shared /proc scan, stop escalation to each of them, reaping
    status.py    RunStatus: what the app shows, read from the run folder
    manager.py   RunManager: start / status / stop / resume / push, one run at a time

A run lives in one directory, ``<runs root>/<run_id>/``::

    run.json        the spec, the command (argv), pid/pgid, start time, and every launch attempt
    train.log       stdout + stderr of the launcher and all its processes (appended on resume)
    data/           train/validation split of an uploaded train file given without a validation file
    metrics.jsonl   written by the training CLI (finetune/train.py, finetune/cli.py), read here for status
    checkpoints/    final/    all_results.json    STOP     (written by the CLI / by RunManager.stop())

Everything the app shows is derived from that directory plus process liveness, so a page
reload, a second viewer or a restarted app re-attaches to a run: nothing important lives only
in memory. run.json's keys: run_id, created, spec (``JobSpec.to_dict()``; folders written before
this package hold the old flat form, which ``JobSpec.from_dict`` still reads), argv, pid, pgid,
started, resume, metrics_offset, log_offset (where this attempt's events and log lines start),
attempts (one entry per launch), exit_code, killed (set when a stop had to SIGKILL the run).

Security: run ids must match ``paths.RUN_ID_RE``; a model or data file given as a local path
must resolve (symlinks followed) inside an allowed root (``paths.allowed_roots()``); commands
are argument lists, never a shell; the child gets the environment without the app's secrets
(``command.run_env``: no TRAIN_PASSWORD, OAuth or gradio secrets; ``HF_TOKEN`` stays, for the Hub),
and it is never written anywhere.
"""
