"""Two "nodes" on one Linux host: two network namespaces joined by a veth pair.

A two-node torchrun rehearsal (notebook 07a, :func:`helpers.engine.cluster.run_job` with
``network=TwoNodeNetwork()``) runs each agent inside its own namespace, so every byte between
the nodes really crosses a network interface, whose kernel counters :meth:`TwoNodeNetwork.counters`
reads. Needs ``ip`` (iproute2) and root or ``CAP_SYS_ADMIN`` + ``CAP_NET_ADMIN``;
:func:`netns_available` says whether this machine permits it, and why not.

Reference: ``ip-netns(8)``, ``veth(4)``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import psutil

from helpers.engine.processes import end_processes

__all__ = ["NetnsUnavailable", "TwoNodeNetwork", "netns_available"]


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not Linux, no ``ip``, or not permitted)."""


def _missing_requirement() -> str | None:
    """Why this machine cannot have network namespaces at all (not Linux, no ``ip``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return (f"network namespaces are a Linux feature and this is {sys.platform}: the two-node "
                "rehearsal over a veth needs Linux (the loopback rehearsal runs everywhere)")
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def netns_available() -> tuple[bool, str]:
    """Can this process create network namespaces? ``(ok, reason)``; tries for real (creates
    and deletes a namespace), since permission depends on capabilities, not only on the uid."""
    missing = _missing_requirement()
    if missing:
        return False, missing
    name = f"ddplab-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"`ip netns add` is not permitted here: {r.stderr.strip() or r.returncode}"
        r = subprocess.run(["ip", "netns", "exec", name, "true"], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"`ip netns exec` is not permitted here: {r.stderr.strip() or r.returncode}"
        # a veth pair with both ends inside the probe namespace (deleted with it)
        r = subprocess.run(["ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"creating a veth pair is not permitted here: {r.stderr.strip() or r.returncode}"
        return True, "ip netns works (root or CAP_SYS_ADMIN + CAP_NET_ADMIN)"
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"`ip netns` failed: {type(e).__name__}: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


@dataclass
class TwoNodeNetwork:
    """Two network namespaces (the "nodes") joined by one veth pair: a private two-host LAN.

    ::

        namespace <name>-n0                 namespace <name>-n1
        lo 127.0.0.1                         lo 127.0.0.1
        <veth0> 10.213.7.1/30  <-- veth -->  <veth1> 10.213.7.2/30   (IPv4 only)

    Nothing is added to the host's network. A context manager: on exit every process inside is killed
    and both namespaces deleted. ``interfaces``: the veth names (each node's ``GLOO_SOCKET_IFNAME``);
    ``names``: the namespaces (pid + random suffix).

    Raises:
        NetnsUnavailable: on entry: not Linux, no ``ip``, or a namespace or the veth pair cannot be
            created (the partial set-up removed first).
    """

    addresses: tuple[str, str] = ("10.213.7.1", "10.213.7.2")
    prefix_len: int = 30
    interface: str = "veth-ddplab"  # <= 15 characters (IFNAMSIZ)
    names: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.names = [f"ddplab-{tag}-n0", f"ddplab-{tag}-n1"]
        # Both ends get the same name: each lives in its own namespace, so there is no clash, and
        # one GLOO_SOCKET_IFNAME serves both nodes.
        self.interfaces = [self.interface, self.interface]

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")

    def __enter__(self) -> "TwoNodeNetwork":
        missing = _missing_requirement()
        if missing:
            raise NetnsUnavailable(missing)
        try:
            for ns in self.names:
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            a, b = self.interfaces
            self._ip("-n", self.names[0], "link", "add", a, "type", "veth", "peer", "name", b, "netns", self.names[1])
            for ns, dev, addr in zip(self.names, self.interfaces, self.addresses):
                # no IPv6: the kernel's own packets after "up" would mix with the job's in the counters
                knob = f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"
                self._ip("netns", "exec", ns, "sh", "-c", f"[ ! -e {knob} ] || echo 1 > {knob}")
                self._ip("-n", ns, "addr", "add", f"{addr}/{self.prefix_len}", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.cleanup()
        return False

    def prefix(self, node: int) -> list[str]:
        """Run a command inside node ``node``'s namespace: ``prefix(node) + argv``."""
        return ["ip", "netns", "exec", self.names[node]]

    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets through node ``node``'s veth so far (the kernel's counters):
        ``{"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}``."""
        r = subprocess.run(["ip", "-n", self.names[node], "-j", "-s", "link", "show", "dev", self.interfaces[node]],
                           capture_output=True, text=True, timeout=20, check=True)
        stats = json.loads(r.stdout)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def exists(self) -> list[str]:
        """The namespaces of this instance that still exist (``[]`` after cleanup)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
        listed = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
        return [n for n in self.names if n in listed]

    def cleanup(self) -> None:
        """Kill every process left in the namespaces, then delete them (idempotent)."""
        for ns in self.names:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
            procs = []
            for pid in r.stdout.split():
                try:
                    procs.append(psutil.Process(int(pid)))
                except (psutil.Error, ValueError):
                    pass
            if procs:
                end_processes(procs, 2.0)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
