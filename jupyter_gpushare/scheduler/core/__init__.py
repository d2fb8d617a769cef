"""The pure core: events in, decisions out.

No module here does I/O, reads a clock or imports the shell: the daemon, the tests and the
simulator (bench/) drive the same code with their own time. tests/test_import_graph.py holds it.
"""
