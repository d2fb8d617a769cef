# /etc/gpushare/gpushare_config.py: the node scheduler's settings (traitlets; every option:
# `gpushare scheduler --help-all`). Used by deploy/systemd/gpushare-scheduler.service.
c = get_config()  # noqa: F821

# Who may connect: members of the group gpushare (the unit's RuntimeDirectoryMode=0750 and this
# mode). For a socket every user may reach: socket_mode = 0o666 and RuntimeDirectoryMode=0755.
c.GPUShareScheduler.socket_group = "gpushare"
c.GPUShareScheduler.socket_mode = 0o660

# The pool each device hands out: the device minus what the driver and other processes keep.
c.GPUShareScheduler.pool_reserve = "1GiB"
c.GPUShareScheduler.base_quantum = 5.0
c.GPUShareScheduler.max_quantum = 60.0

# JupyterHub with a local spawner that runs every single-user server as the hub's uid, or
# Kubernetes pods that all run as uid 1000: the users sharing that uid prove who they are with
# a token (GPUSHARE_USER_TOKEN) derived from this key. Create it with
#   gpushare keygen /etc/gpushare/user.key && chown gpushare: /etc/gpushare/user.key
# c.GPUShareScheduler.token_uids = ["jupyterhub"]  # or [1000]
# c.GPUShareScheduler.user_key_file = "/etc/gpushare/user.key"

# Prometheus metrics on http://127.0.0.1:9464/metrics (per-user data: keep it off the open net).
c.GPUShareScheduler.metrics_port = 9464
