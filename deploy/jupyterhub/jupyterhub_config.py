"""JupyterHub on one machine whose GPUs jupyter-gpushare shares among every user's kernels.

Install (as root, in the hub's environment): ``pip install jupyterhub jupyter-gpushare`` and
``npm install -g configurable-http-proxy``. Then, once:

    gpushare keygen /etc/gpushare/user.key            # the node's user key (mode 0600)

run the node scheduler as a service (docs/operators/node-scheduler.md):

    gpushare scheduler --GPUShareScheduler.user_key_file=/etc/gpushare/user.key

and start the hub with this file: ``jupyterhub -f /etc/jupyterhub/jupyterhub_config.py``.
docs/operators/jupyterhub.md explains each part. The project's tests start a real hub with this
file (tests/hub/), replacing only the authenticator, the spawner and the ports.
"""

import os

import jupyter_gpushare.hub

c = get_config()  # noqa: F821 (JupyterHub's config loader provides get_config)

# -- Users and their servers -----------------------------------------------------------------
# System accounts: PAM checks passwords and LocalProcessSpawner starts each user's server as that
# user's uid, so the scheduler also tells users apart by uid. With a spawner that runs everyone
# under one uid (containers, SimpleLocalProcessSpawner), the token set below is what tells them
# apart: see "One uid for everyone" in docs/operators/jupyterhub.md.
c.JupyterHub.authenticator_class = "pam"
c.JupyterHub.spawner_class = "localprocess"
c.Authenticator.allowed_users = set()  # fill in, or use allow_all / a group
c.Authenticator.admin_users = set()
c.JupyterHub.bind_url = "http://:8000"  # behind a TLS proxy, or set ssl_cert and ssl_key
c.Spawner.default_url = "/lab"

# -- GPU sharing -----------------------------------------------------------------------------
# Every user's server uses the node scheduler (GPUSHARE_SCHEDULER=node, GPUSHARE_SOCKET) instead of
# embedding its own, and carries GPUSHARE_USER and GPUSHARE_USER_TOKEN: the hub's word for who the
# user is, which the scheduler checks with the same key. The key is read here, once: a hub that
# cannot read it does not start. $GPUSHARE_USER_KEY_FILE overrides the path.
# GPUSHARE_SERVICE_USER names the account the node scheduler runs as (deploy/systemd's unit:
# gpushare): kernels trust its socket only then, else they run unshared. "" for a root scheduler.
jupyter_gpushare.hub.configure(
    c,
    key_file=os.environ.get("GPUSHARE_USER_KEY_FILE", "/etc/gpushare/user.key"),
    socket="/run/gpushare/scheduler.sock",
    service_user="gpushare",
)
