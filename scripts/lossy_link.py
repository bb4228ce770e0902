"""A slow, lossy link in user space, for a kernel without the netem qdisc.

`python scripts/lossy_link.py NODE_END BRIDGE_END DELAY LOSS SEED` creates two TAP devices in its
network namespace and relays every Ethernet frame between them. A frame the node sends (read on
NODE_END) is dropped with probability LOSS, otherwise delivered DELAY seconds after it arrived, in
arrival order; a frame to the node passes at once. That is what `tc qdisc add dev eth0 root netem
delay DELAY loss LOSS` on the node does (netem shapes a device's egress): a round trip gains
DELAY, and the node's data and its acknowledgements are lost. `scripts/hosts.py` moves NODE_END
into a node's namespace as its eth0 and puts BRIDGE_END on the bridge. The relay prints "ready"
once both devices exist and runs until SIGTERM, then prints "relayed R dropped D" (the node's
frames).
"""
from __future__ import annotations

import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
FRAME = 65536


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(node: int, bridge: int, delay: float, loss: float, chance: random.Random,
          counts: dict[str, int]) -> None:
    """Until interrupted: frames from the node reach the bridge after `delay`, or are dropped
    (`counts` says how many of each); frames from the bridge reach the node at once."""
    queued: list[tuple[float, int, bytes]] = []  # (due, arrival order, frame), to the bridge
    while True:
        wait = max(0.0, queued[0][0] - time.monotonic()) if queued else None
        readable, _, _ = select.select([node, bridge], [], [], wait)
        now = time.monotonic()
        for frame in _drain(bridge) if bridge in readable else ():
            _send(node, frame)
        for frame in _drain(node) if node in readable else ():
            if chance.random() < loss:
                counts["dropped"] += 1
            else:
                counts["relayed"] += 1
                heapq.heappush(queued, (now + delay, counts["relayed"], frame))
        while queued and queued[0][0] <= time.monotonic():
            _send(bridge, heapq.heappop(queued)[2])


def _drain(fd: int) -> list[bytes]:
    frames = []
    while True:
        try:
            frames.append(os.read(fd, FRAME))
        except BlockingIOError:
            return frames


def _send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:  # the device is down (a namespace being deleted): the frame is lost
        pass


def main(argv: list[str]) -> None:
    node_end, bridge_end, delay, loss, seed = argv
    node, bridge = open_tap(node_end), open_tap(bridge_end)
    counts = {"relayed": 0, "dropped": 0}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        relay(node, bridge, float(delay), float(loss), random.Random(int(seed)), counts)
    finally:
        print(f"relayed {counts['relayed']} dropped {counts['dropped']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
