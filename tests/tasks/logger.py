"""Loggers of a user's own for tests/test_loggers.py (``--logger tests/tasks/logger.py:make``).

``make`` writes what it is told to FLODL_TEST_OUT/logger.jsonl: first the run's description, then one
line per ``log(values, step)``, then ``closed``. ``broken`` is a logger whose ``log`` raises.
"""

import json
import os


class JsonLines:
    def __init__(self, run):
        self.file = open(os.path.join(os.environ["FLODL_TEST_OUT"], "logger.jsonl"), "w")
        self._write({"run": run})

    def _write(self, obj):
        self.file.write(json.dumps(obj) + "\n")
        self.file.flush()

    def log(self, values, step):
        self._write({"step": step, "values": values})

    def close(self):
        self._write({"closed": True})
        self.file.close()


class Broken:
    def log(self, values, step):
        raise RuntimeError("this logger's service is down")


def make(run):
    return JsonLines(run)


def broken(run):
    return Broken()
