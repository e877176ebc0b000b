"""Helpers shared by the test modules: processes, the CPU averaging plane, the browser, namespace hosts."""
