"""Helpers of the JupyterHub end-to-end test: a real JupyterHub (configurable-http-proxy from npm,
SimpleLocalProcessSpawner, DummyAuthenticator) in a subprocess, configured by the shipped
deploy/jupyterhub/jupyterhub_config.py with only the authenticator, the spawner, ports and state
files replaced; users who log in through the hub's login form; and kernels driven through the
single-user servers' REST and websocket APIs, through the proxy, as a browser would.

A uniquely named module (not conftest) so that other test directories' helpers never collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"
#: configurable-http-proxy is installed here (git-ignored) when it is not on PATH.
CHP_PREFIX = ROOT / ".cache" / "chp"
CHP_PACKAGE = "configurable-http-proxy@5"
PASSWORD = "gpushare-hub-test"
#: The shipped "Python 3 (GPU shared)" kernelspec (jupyter-data/kernels/python3-gpushare).
KERNEL = "python3-gpushare"

__all__ = [
    "KERNEL",
    "PASSWORD",
    "Hub",
    "HubUser",
    "find_or_install_chp",
]


def find_or_install_chp() -> str:
    """The configurable-http-proxy command: on PATH, in .cache/chp, or installed there by npm.

    No skip: the hub test is part of CI, so a missing npm is a failure that says what to do."""
    found = shutil.which("configurable-http-proxy")
    if found:
        return found
    local = CHP_PREFIX / "node_modules" / ".bin" / "configurable-http-proxy"
    if local.exists():
        return str(local)
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(
            "the JupyterHub test needs configurable-http-proxy, and npm is not there to install "
            "it: install Node.js and npm (apt-get install nodejs npm), or "
            "npm install -g configurable-http-proxy",
            pytrace=False,
        )
    CHP_PREFIX.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(CHP_PREFIX)]
    out = subprocess.run(
        [*cmd, CHP_PACKAGE], capture_output=True, text=True, timeout=600, check=False
    )
    if out.returncode != 0 or not local.exists():
        pytest.fail(
            f"npm could not install {CHP_PACKAGE} into {CHP_PREFIX} (exit {out.returncode}):\n"
            f"{out.stdout}\n{out.stderr}",
            pytrace=False,
        )
    return str(local)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str, check: Callable[[], Any], timeout: float, describe: Callable[[], str]
) -> Any:
    """``check()``'s first true value within ``timeout`` seconds; else fail with ``describe()``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
        except (requests.RequestException, OSError) as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what} ({last})\n{describe()}"
            )
        time.sleep(0.1)


class Hub:
    """``jupyterhub -f <config>`` in a subprocess; its log (with the proxy's and the single-user
    servers', which inherit its output) in ``log``."""

    def __init__(
        self, tmp: Path, *, chp: str, key_file: Path, socket_path: Path, env: dict[str, str]
    ) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = tmp / "jupyterhub.log"
        home = tmp / "home"
        config = tmp / "jupyterhub_config.py"
        root = os.getuid() == 0
        config.write_text(
            f"""\
import sys
c = get_config()  # noqa
load_subconfig({str(DEPLOY_CONFIG)!r})
# What a test run replaces: who logs in, how servers start, where the hub listens and keeps state.
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {PASSWORD!r}
c.Authenticator.allowed_users = {{"alice", "bob"}}
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {str(home)!r} + "/{{username}}"
c.JupyterHub.bind_url = "http://127.0.0.1:{self.port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.ConfigurableHTTPProxy.pid_file = {str(tmp / "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///" + {str(tmp / "hub.sqlite")!r}
c.JupyterHub.cookie_secret_file = {str(tmp / "cookie_secret")!r}
c.JupyterHub.cleanup_servers = True
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.args = {["--allow-root"] if root else []!r}
c.Spawner.start_timeout = 90
c.Spawner.http_timeout = 90
c.Spawner.default_url = "/tree"
c.Spawner.environment.update({env!r})
"""
        )
        hub_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "JUPYTER"))
        }
        hub_env.pop("LD_PRELOAD", None)
        hub_env.pop("PYTEST_CURRENT_TEST", None)
        hub_env["GPUSHARE_USER_KEY_FILE"] = str(key_file)
        hub_env["PYTHONUNBUFFERED"] = "1"
        # The venv's bin first: the hub finds no other jupyterhub-singleuser or python.
        hub_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), hub_env["PATH"]])
        self.socket_path = socket_path
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(config), "--debug"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=hub_env,
                cwd=tmp,
                start_new_session=True,
            )
        wait_for("the hub to answer", self._answers, 60, self.describe)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"jupyterhub exited ({self.proc.returncode})\n{self.describe()}")
        return requests.get(self.url + "hub/api/", timeout=5).status_code == 200

    def describe(self) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        return (
            f"--- jupyterhub log (with the proxy and the single-user servers) ---\n{text[-40000:]}"
        )

    def login(self, name: str, password: str = PASSWORD) -> HubUser:
        """Log in through the hub's login form, as a browser does; then ask the hub for an API
        token (with the login cookie and the form's XSRF token)."""
        session = requests.Session()
        r = session.get(self.url + "hub/login", timeout=30)
        r.raise_for_status()
        xsrf = _latest_cookie(session, "_xsrf")
        assert xsrf, f"no _xsrf cookie from the login page: {r.headers}"
        r = session.post(
            self.url + "hub/login",
            data={"username": name, "password": password, "_xsrf": xsrf},
            allow_redirects=False,
            timeout=30,
        )
        if r.status_code != 302:
            raise AssertionError(f"login of {name} answered {r.status_code}: {r.text[:2000]}")
        # The XSRF token is bound to the login session: take the one a page gives after login.
        r = session.get(self.url + "hub/home", timeout=30)
        r.raise_for_status()
        xsrf = _latest_cookie(session, "_xsrf")
        r = session.post(
            self.url + f"hub/api/users/{name}/tokens",
            json={"note": "gpushare hub test", "expires_in": 3600},
            headers={"X-XSRFToken": xsrf},
            timeout=30,
        )
        assert r.status_code in (200, 201), f"token for {name}: {r.status_code} {r.text}"
        return HubUser(self, name, r.json()["token"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM: the hub stops the single-user servers (cleanup_servers) and the proxy.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class HubUser:
    """A logged-in hub user with an API token: their server, kernels and gpushare API."""

    def __init__(self, hub: Hub, name: str, token: str) -> None:
        self.hub = hub
        self.name = name
        self.token = token
        self.headers = {"Authorization": f"token {token}"}

    # -- the hub ---------------------------------------------------------------------------

    def hub_api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(
            method, self.hub.url + "hub/api/" + path, headers=self.headers, timeout=30, **kwargs
        )

    def start_server(self) -> None:
        r = self.hub_api("POST", f"users/{self.name}/server")
        assert r.status_code in (201, 202), f"{self.name}'s server: {r.status_code} {r.text}"

    def wait_server(self, timeout: float = 90) -> None:
        def ready() -> bool:
            model = self.hub_api("GET", f"users/{self.name}").json()
            server = model.get("servers", {}).get("")
            if server is None and not model.get("pending"):
                raise AssertionError(
                    f"{self.name}'s server is gone: {model}\n{self.hub.describe()}"
                )
            return bool(server and server.get("ready"))

        wait_for(f"{self.name}'s server", ready, timeout, self.hub.describe)

    # -- the single-user server, through the proxy ----------------------------------------------

    @property
    def server_url(self) -> str:
        return self.hub.url + f"user/{self.name}/"

    def api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(
            method, self.server_url + path, headers=self.headers, timeout=60, **kwargs
        )

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.api(method, path, **kwargs)
        assert r.ok, (
            f"{self.name}: {method} {path}: {r.status_code} {r.text}\n{self.hub.describe()}"
        )
        return r.json()

    def start_kernel(self, name: str = KERNEL) -> str:
        return str(self.json("POST", "api/kernels", json={"name": name})["id"])

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = self.json("GET", "gpushare/api/status")
        return doc

    def execute(self, kernel_id: str, code: str, timeout: float = 60) -> str:
        """Run ``code`` in the kernel over the kernel's websocket (through the proxy, with the
        user's token); its stdout. Fails with the traceback when the cell fails."""
        url = self.server_url.replace("http://", "ws://") + f"api/kernels/{kernel_id}/channels"
        ws = websocket.create_connection(
            url, header=[f"Authorization: token {self.token}"], timeout=timeout
        )
        try:
            msg_id = uuid.uuid4().hex
            ws.send(json.dumps(_execute_request(msg_id, code, self.name)))
            stdout: list[str] = []
            reply: dict[str, Any] | None = None
            idle = False
            deadline = time.monotonic() + timeout
            while reply is None or not idle:
                if time.monotonic() > deadline:
                    raise AssertionError(f"cell still running after {timeout}s: {stdout}")
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    stdout.append(content["text"])
                elif kind == "execute_reply":
                    reply = content
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
        finally:
            ws.close()
        text = "".join(stdout)
        if reply.get("status") != "ok":
            raise AssertionError(
                f"{self.name}'s cell failed: {reply.get('ename')}: {reply.get('evalue')}\n"
                + "\n".join(reply.get("traceback", []))
                + f"\nstdout:\n{text}\n{self.hub.describe()}"
            )
        return text


def _latest_cookie(session: requests.Session, name: str) -> str:
    """The value of the cookie ``name`` set last (the jar may hold one per path)."""
    values = [c.value for c in session.cookies if c.name == name and c.value]
    return values[-1] if values else ""


def _execute_request(msg_id: str, code: str, user: str) -> dict[str, Any]:
    return {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": user,
            "session": uuid.uuid4().hex,
            "version": "5.3",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "channel": "shell",
        "buffers": [],
    }
