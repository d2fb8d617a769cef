"""The asyncio shell around the core.

The socket and its peers (transport, access, shims), the translation of messages into the core's
events (translate), the control and status requests, metrics, logs and configuration. server.py
wires the core, the shell and the features together.
"""
