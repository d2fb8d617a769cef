"""The node's GPU scheduler.

A pure policy core (policy.py) wrapped by an asyncio shell (server.py).
"""
