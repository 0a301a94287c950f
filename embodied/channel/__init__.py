"""Channels: named, keyed FIFO queues that carry bulk data between worker processes
(``channel.py``; the modules beside it hold its parts: ``segments`` shared memory and futexes,
``ring`` a key's queue, ``codec`` a message's skeleton and arrays, ``remote`` the Ray fallback
across nodes), and ``keys``, the names the env, rollout and actor workers trade under."""

from embodied.channel.channel import Channel
from embodied.channel.segments import ChannelError

__all__ = ["Channel", "ChannelError"]
