"""On PYTHONPATH only for a run a test injects faults into (tests/fault_injection.py, `env`): Python
runs this at start-up in every process of that run."""

import fault_injection

fault_injection.attach_on_import()
