"""The node's GPU scheduler, in three rooms.

core/      the pure policy: events in, decisions out (shared with the simulator in bench/)
shell/     the asyncio daemon around it: socket, peers, translation, access, control, metrics
features/  what plugs into both: MPS, deep idle, Kubernetes allocations, history
"""
