"""A worker that cannot start says why in one line and exits 1, before loading a model where it
can: a port in use, a model that is not there, a port out of range (argparse's 2)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tokenwire.grpc_tls import check_bindable
from tokenwire.stack import free_port


@pytest.mark.parametrize("module", ["model_worker", "detok_worker"])
def test_a_port_in_use_is_one_line_before_anything_loads(module: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", module, "--port", str(port), "--max-model-len", "128"]
                              if module == "model_worker" else [sys.executable, "-m", module, "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"ERROR {module}: cannot serve on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr and "KV cache" not in done.stderr  # no model was loaded
    assert time.monotonic() - began < 60


def test_a_missing_model_is_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "model_worker", "--port", "0", "--model", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ERROR model_worker: cannot start: --model" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_port_out_of_range_is_a_flag_error() -> None:
    done = subprocess.run([sys.executable, "-m", "model_worker", "--port", "99999"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "python -m model_worker: error: --port must be in 0..65535" in done.stderr


def test_check_bindable_takes_port_0_and_ipv6_and_names_the_address() -> None:
    check_bindable("127.0.0.1", 0)
    if socket.has_ipv6:
        try:
            with socket.create_server(("::1", 0), family=socket.AF_INET6) as free:
                port = free.getsockname()[1]
        except OSError:
            pytest.skip("no IPv6 loopback here")
        check_bindable("::1", port)  # an IPv6 host: the stack's check only knew IPv4
        check_bindable("[::1]", port)  # as a worker's --host writes it for grpc (it was refused)
    check_bindable("", free_port())  # the wildcard, as the stack's --host "" means
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(OSError, match="cannot serve on 127.0.0.1"):
        check_bindable("127.0.0.1", taken.getsockname()[1])
