"""The modules trainkit starts as processes (`python -m MODULE`), each named once, here.

A process boundary is the one place a lower layer names a higher one without importing it: the
recipe layer prints the torchrun command that runs the worker, the system monitor recognises its
sibling workers by it, and `tune` and `bench scaling` start `trainkit run` as a child. Import the
constant, never spell the module: tests/test_layering.py refuses any other string naming a module
of a higher layer, and checks that each module here runs as `__main__`.
"""

WORKER = "trainkit.runtime.worker"  # one training process (under torchrun, or alone: `-m WORKER RUN_DIR`)
CLI = "trainkit.cli"  # the `trainkit` command, run as a child process of trainkit itself
