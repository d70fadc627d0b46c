"""Free TCP ports for the tests' Python and shell parts.

  python3 tests/support/free_ports.py COUNT LOW HIGH   prints COUNT distinct ports, space separated

A port here is one no socket holds (on any address), drawn from [LOW, HIGH) in random order. The
tests take theirs from below the kernel's ephemeral range (32768 and up), which every connect()
draws its local port from: a port found free there could become some connection's local port
before the test's server binds it. Each caller keeps to a range of its own (the C++ freePort()
uses [16384, 28672) and reserves what it hands out), so concurrent tests do not pick alike.
"""
import random
import socket
import sys


def free_ports(count, low, high):
    got = []
    for port in random.sample(range(low, high), high - low):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        got.append(port)
        if len(got) == count:
            return got
    raise RuntimeError(f"no {count} free ports in [{low}, {high})")


if __name__ == "__main__":
    print(" ".join(map(str, free_ports(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))))
