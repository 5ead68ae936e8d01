"""``replicas.spec.host_port``: the one parser of replica addresses
(router.yaml's ``address``, ``replica --listen``/``--openai``, the connect)."""

from __future__ import annotations

import pytest

from replicas.spec import address_error, host_port, join_host_port


@pytest.mark.parametrize(("text", "parsed"), [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)),
    ("gpu-host.example:9", ("gpu-host.example", 9)),
    ("[::1]:7000", ("::1", 7000)),
    ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ("localhost:0", ("localhost", 0)),
])
def test_host_and_port(text: str, parsed: tuple[str, int]) -> None:
    assert host_port(text) == parsed


@pytest.mark.parametrize("text", [
    "::1",  # (read as host "::" and port 1 before: a replica at the wrong address, no error)
    "::1:7000",  # (an IPv6 host needs brackets: which colon starts the port is a guess)
    "fe80::1:80",
    "[]:7000",
    "[::1]",
    "[::1:7000",
    "127.0.0.1",
    "127.0.0.1:",
    ":7000",
    "127.0.0.1:65536",
    "127.0.0.1:-1",
    "127.0.0.1:x",
    "h:\u00b2",  # (a digit to str.isdigit, not to int(): a ValueError traceback)
    "h:\u0663",  # (an Arabic-Indic 3: port 3)
    "[a]b]:1",
])
def test_not_host_and_port(text: str) -> None:
    assert host_port(text) is None


def test_the_config_error_says_ipv6_takes_brackets() -> None:
    error = address_error("::1")
    assert error is not None and "[::1]:7000" in error and "'::1'" in error


@pytest.mark.parametrize(("host", "port"), [("127.0.0.1", 7000), ("::1", 7000), ("gpu-host", 1)])
def test_an_address_written_out_reads_back(host: str, port: int) -> None:
    assert host_port(join_host_port(host, port)) == (host, port)
