"""The guards: everything that protects a run, apart from the spine that runs it.

The spine (`train` -> `driver` -> `loop` -> `updater` -> `checkpoint.checkpointer`)
calls each guard in one line, through the guard's public functions; a reader who
skips this package still understands the run. ARCHITECTURE.md lists every module.
"""
