"""Helpers shared by the test suites (on sys.path through pytest's pythonpath)."""
