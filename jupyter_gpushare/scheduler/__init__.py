"""The node's GPU scheduler: a pure policy core (policy.py) wrapped by an asyncio shell (server.py)."""
