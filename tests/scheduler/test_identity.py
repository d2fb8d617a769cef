"""User tokens (jupyter_gpushare.identity) and `gpushare keygen`."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from jupyter_gpushare.cli import main
from jupyter_gpushare.identity import (
    KeyFileError,
    generate_key,
    load_key,
    user_environment,
    user_token,
    verify_token,
)

KEY = bytes(range(32))


def test_token_is_a_domain_separated_hmac() -> None:
    import hashlib
    import hmac

    token = user_token(KEY, "alice")
    # HMAC-SHA256 in lowercase hex of a versioned domain and the name: the same token from every
    # release (a spawner's tokens outlive a scheduler upgrade), so it is pinned here.
    domain = b"jupyter-gpushare user token v1\x00"
    assert token == hmac.new(KEY, domain + b"alice", hashlib.sha256).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", token), token
    # Not the bare HMAC of the name: a token is useless for any other protocol using the key.
    assert token != hmac.new(KEY, b"alice", hashlib.sha256).hexdigest()
    assert token == user_token(KEY, "alice")
    assert token != user_token(KEY, "bob")
    assert token != user_token(bytes(32), "alice")


def test_user_environment() -> None:
    env = user_environment(KEY, "alice")
    assert env == {"GPUSHARE_USER": "alice", "GPUSHARE_USER_TOKEN": user_token(KEY, "alice")}


def test_verify_token() -> None:
    token = user_token(KEY, "alice")
    assert verify_token(KEY, "alice", token)
    assert verify_token(KEY, "alice", token.upper())  # hex is hex
    assert not verify_token(KEY, "bob", token)
    assert not verify_token(KEY, "alice", token[:-1] + ("0" if token[-1] != "0" else "1"))
    assert not verify_token(KEY, "alice", "")
    assert not verify_token(KEY, "", token)
    assert not verify_token(b"", "alice", token)
    assert not verify_token(KEY, "alice", "ünïcode")
    with pytest.raises(ValueError):
        user_token(KEY, "")


def test_generate_and_load(tmp_path: Path) -> None:
    path = tmp_path / "user.key"
    old_umask = os.umask(0)  # even a permissive umask must not leave the key readable
    try:
        generate_key(str(path))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_key(str(path))
    assert len(key) == 32
    with pytest.raises(FileExistsError, match="--force"):
        generate_key(str(path))
    generate_key(str(path), force=True)
    assert load_key(str(path)) != key
    assert [p.name for p in tmp_path.iterdir()] == ["user.key"]  # no temporary left behind


def test_load_key_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.key"
    with pytest.raises(KeyFileError, match=r"does not exist.*gpushare keygen"):
        load_key(str(missing))
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(KeyFileError, match="is empty"):
        load_key(str(empty))
    short = tmp_path / "short.key"
    short.write_text("00ff00ff\n")
    short.chmod(0o600)
    with pytest.raises(KeyFileError, match="4 bytes of key; at least 16"):
        load_key(str(short))
    for mode in (0o640, 0o604):
        loose = tmp_path / f"loose{mode:o}.key"
        loose.write_text("ab" * 32)
        loose.chmod(mode)
        with pytest.raises(KeyFileError, match=rf"mode {mode:04o}.*chmod 600"):
            load_key(str(loose))
    directory = tmp_path / "dir.key"
    directory.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_key(str(directory))
    raw = tmp_path / "raw.key"
    raw.write_bytes(b"not hex at all, but long enough!")
    raw.chmod(0o600)
    assert load_key(str(raw)) == b"not hex at all, but long enough!"


def test_keygen_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "user.key"
    main(["keygen", str(path)])
    assert "wrote a new key" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(SystemExit) as exc:
        main(["keygen", str(path)])
    assert exc.value.code == 1
    assert "--force" in capsys.readouterr().err
    main(["keygen", str(path), "--token-for", "alice"])
    token = capsys.readouterr().out.strip()
    assert verify_token(load_key(str(path)), "alice", token)
    with pytest.raises(SystemExit) as exc:
        main(["keygen"])
    assert exc.value.code == 2
