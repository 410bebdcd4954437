"""The API key off every command line: where `serve`, the adapter, the gateway and tritonserver read it from
(environment or file), what tritonserver is given instead (a derived header value on every API but health), and
that the processes which need no key do not inherit it. The whole stack with a key: test_stack_security.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonllm import cli, gateway, launcher
from tritonllm.adapter.settings import AdapterSettings
from tritonllm.interface import settings
from tritonllm.interface.api_key import (API_KEY_ENV, RESTRICTED_APIS, TRITON_GRPC_KEY_HEADER, TRITON_KEY_HEADER,
                                         read_api_key, triton_headers, triton_secret)

KEY = "sk-unit-test-key"
REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_key_variable_is_the_settings_own():
    [field] = [field for field in dataclasses.fields(AdapterSettings) if field.name == "api_key"]
    assert settings.env_name(field) == API_KEY_ENV


@pytest.mark.parametrize("command", ["serve", "gateway", "scale-out", "tritonserver"])
def test_every_command_reads_the_key_from_the_environment_or_a_file(command, tmp_path, monkeypatch):
    places = {"tritonserver": [str(tmp_path)]}.get(command, [])
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert cli.build_parser().parse_args([command, *places]).api_key == KEY
    monkeypatch.delenv(API_KEY_ENV)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")  # as `echo` writes it
    args = cli.build_parser().parse_args([command, *places, "--api-key-file", str(key_file)])
    assert read_api_key(args.api_key, args.api_key_file) == KEY


def test_a_key_file_must_hold_a_key_and_the_key_comes_from_one_place(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None, str(empty))
    with pytest.raises(FileNotFoundError):
        read_api_key(None, str(tmp_path / "missing"))
    (tmp_path / "key").write_text(KEY)
    with pytest.raises(ValueError, match="not both"):
        read_api_key("another", str(tmp_path / "key"))
    assert read_api_key("", None) is None  # an empty variable (Compose's default) means no key
    assert cli.main(["tritonserver", str(tmp_path), "--api-key-file", str(tmp_path / "missing")]) == 1


def test_adapter_settings_read_the_file_once_and_keyed_metrics_need_a_key(tmp_path):
    (tmp_path / "key").write_text(KEY)
    read = AdapterSettings(served_model_name="m", api_key_file=str(tmp_path / "key"))
    assert (read.api_key, read.api_key_file) == (KEY, None)
    assert dataclasses.replace(read, max_n=2).api_key == KEY
    with pytest.raises(ValueError, match="metrics-require-key"):
        AdapterSettings(served_model_name="m", metrics_require_key=True)


def test_triton_gets_a_derived_value_on_every_api_but_health(tmp_path):
    server = launcher.TritonServer(tmp_path, tmp_path, tritonserver=Path("/bin/true"), api_key=KEY)
    command = server._command(tmp_path)
    secret = triton_secret(KEY)
    restriction = f"{','.join(RESTRICTED_APIS)}:{TRITON_KEY_HEADER}={secret}"
    assert f"--http-restricted-api={restriction}" in command and f"--grpc-restricted-protocol={restriction}" in command
    assert "health" not in RESTRICTED_APIS and not any(KEY in part for part in command)
    assert secret != KEY and secret == triton_secret(KEY) != triton_secret(KEY + "x")
    # gRPC's metadata key is the option's with tritonserver's prefix; each protocol ignores the other's
    assert server.headers == {TRITON_KEY_HEADER: secret, TRITON_GRPC_KEY_HEADER: secret}


def test_without_a_key_nothing_changes(tmp_path):
    server = launcher.TritonServer(tmp_path, tmp_path, tritonserver=Path("/bin/true"))
    assert not [part for part in server._command(tmp_path) if "restricted" in part]
    assert server.headers == triton_headers(None) == {}


def test_tritonserver_and_the_engine_never_inherit_the_key(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert API_KEY_ENV not in launcher.server_env(Path("/bin/true"))


def test_the_tritonserver_command_becomes_a_guarded_tritonserver(tmp_path):
    """What docker-compose.yml's triton service runs: tritonserver with the restriction, the key in no argument
    and not in its environment."""
    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\nenv\n')
    fake.chmod(0o755)
    env = {**os.environ, "TRITONSERVER": str(fake), API_KEY_ENV: KEY, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "tritonllm", "tritonserver", str(tmp_path / "repo"),
                             "--triton-host", "0.0.0.0", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"--model-repository={tmp_path / 'repo'}" in lines and "--grpc-address=0.0.0.0" in lines
    assert f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{TRITON_KEY_HEADER}={triton_secret(KEY)}" \
        in lines
    assert KEY not in result.stdout


def test_the_gateway_gets_the_key_inside_its_process(monkeypatch):
    """smg takes the key only as an argument: it is added in tritonllm.gateway's main, after the exec, so the
    command line (ps) never holds it."""
    command = gateway.gateway_command(gateway.GatewaySettings(worker_urls="http://a:9000"))
    assert KEY not in " ".join(command)
    env = gateway.gateway_env(KEY)
    assert env[API_KEY_ENV] == KEY and API_KEY_ENV not in gateway.gateway_env(None)
    received = []
    monkeypatch.setattr("smg.cli.main", received.append)
    monkeypatch.setattr(sys, "argv", command[2:])  # as `python -m tritonllm.gateway ...` sees them
    monkeypatch.setenv(API_KEY_ENV, KEY)
    gateway.main()
    assert received == [[*command[3:], "--api-key", KEY]]
    assert API_KEY_ENV not in os.environ  # smg's own children do not inherit it


def test_every_api_group_of_this_tritonserver_but_health_is_restricted():
    """The groups as the binary's --help lists them: a release that adds one fails here, not silently open."""
    tritonserver = launcher.find_tritonserver()
    result = subprocess.run([str(tritonserver), "--help"], capture_output=True, text=True, timeout=60,
                            env=launcher.server_env(tritonserver))
    help_text = result.stdout + result.stderr
    for option, label in (("--http-restricted-api", "Allowed APIs:"), ("--grpc-restricted-protocol",
                                                                         "Allowed protocols:")):
        section = help_text.split(f"  {option} ", 1)[1]
        listed = section.split(label, 1)[1].split("\n\n", 1)[0]
        groups = {group.strip() for group in " ".join(listed.split()).split(",")}
        assert groups == {"health", *RESTRICTED_APIS}, option
